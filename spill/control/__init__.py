"""One writer per run: control objects, leases, fencing, payload pointers and moves.

``owner`` (who a process is, whether it is gone), ``keys`` (the control keys under ``runs/``
and reading them; their conditional writes are ``spill.store.cas``), ``control`` (a run's
owner: transitions and heartbeat), ``runs`` (acquiring a location's run), ``runlist`` (the run
list rebuilt from the control objects when it is missing; a new run's generation, above every
one in use), ``place`` (a job's payloads and pointers, and what no collection may remove),
``arrival`` and ``transfer`` (the two ends of ``spill move``). Engine-free; it sits above
``spill.store``, whose files, conditional writes and drills it uses, and below the payload
formats (``spill.payloads``).
"""
