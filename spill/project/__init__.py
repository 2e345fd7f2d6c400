"""The declarative project layer: spill.yaml -> plan -> build (engine-free).

``config`` is the one Hydra boundary, ``data`` turns the data file into each stage's rows,
``stages`` and ``plan`` decide (pure), ``build`` executes through ``spill.jobs``, ``state``
reads and writes the build state, ``status`` prints it, ``sweep`` runs Hydra multiruns and
``init`` writes a new project.
"""
