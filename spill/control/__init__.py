"""One writer per run: control objects, leases, fencing, payload pointers and moves.

``owner`` (who a process is, whether it is gone), ``cas`` (conditional writes of the control
keys: flock locally; ``objstore``: If-None-Match / If-Match on an object store, and the probe
that refuses a store without them), ``control`` (a run's owner: transitions and heartbeat),
``runs`` (acquiring a location's run), ``runlist`` (the run list rebuilt from the control
objects when it is missing; a new run's generation, above every one in use), ``place`` (a
job's payloads and pointers, and what no collection may remove), ``transfer`` (the steps of
``spill move``). Engine-free; it sits beside ``spill.store`` (files and formats), which it
uses for file access, drills and schemas.
"""
