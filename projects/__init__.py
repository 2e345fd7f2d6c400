"""The example projects (``toy``, ``tickets``), shipped as ``spill.projects`` so that ``spill
example`` can copy one from a wheel as well as from a checkout. Each folder is a complete project:
``spill build projects/<name>``.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ("toy", "tickets")
