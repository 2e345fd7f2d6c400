"""The declarative project layer: spill.yaml -> plan -> build; move; bundle; report (engine-free).

On top: ``config`` (the one Hydra boundary), ``sources`` (the compose key and data hash a build
is made from), ``data`` (the data file's rows and split), ``init``, ``sweep``, ``predict``,
``owned`` and ``remote``. One room per verb family: ``build`` (stages, planner, executor,
``state.json``), ``bundle``, ``move`` and ``report`` (``spill status`` and ``spill report``).
"""
