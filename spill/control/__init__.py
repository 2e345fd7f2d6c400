"""One writer per run: control objects, leases, fencing, payload pointers and moves.

``owner`` (who a process is, whether it is gone), ``keys`` (the control keys under ``runs/``,
reading them, the run list rebuilt when missing; their conditional writes are
``spill.store.cas``), ``control`` (a run's owner: transitions and heartbeat), ``place`` (a job's
payloads and pointers, and what no collection may remove), ``ownership`` (acquiring a
location's run, at a generation above every one in use), ``arrival`` and ``transfer`` (the two
ends of ``spill move``). Engine-free: above ``spill.store``, below ``spill.payloads``.
"""
