"""spill's JSON Schemas, one ``<name>.schema.json`` per file format spill writes or reads.

The folder sits at the top of the repository and ships inside the installed package as
``spill.schemas`` (setuptools ``package-dir``); ``spill.ground.validate`` loads and applies them.
``DIR`` is where they are on this machine.
"""

from pathlib import Path

DIR = Path(__file__).resolve().parent
