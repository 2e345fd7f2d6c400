"""``spill build``: the stages as objects, the pure planner, the thin executor and the state it
records (``build`` is the verb; ``stages``, ``specs``, ``plan``, ``execute``, ``record``)."""
