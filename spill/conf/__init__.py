"""spill's Hydra config groups, read through the ``pkg://spill.conf`` search path.

A project's ``spill.yaml`` picks one option per group in its defaults list; the project's own
values and command-line overrides are applied on top (``spill.project.config``). This package
exists so that ``pkg://`` finds the files in a wheel as well as in a checkout.
"""
