from spill.cli import entry

entry()
