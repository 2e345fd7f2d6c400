"""The measured reports, of which only the noise floor ships (as ``spill.reports``): the relay
example judges a relayed build by the tolerance measured in ``*-noise-floor.json``.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent
