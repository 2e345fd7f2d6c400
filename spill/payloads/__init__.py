"""The payload formats: what a job writes into the payload folders of its run's place
(``spill.control.place``) and reads back only while a pointer names them. ``checkpoint`` (tune
checkpoints) and ``rows`` (a row job's committed segments). Engine-free; above ``spill.control``,
whose fenced publications they go through, and below ``spill.jobs``.
"""
