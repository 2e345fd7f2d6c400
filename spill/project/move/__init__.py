"""``spill move``: a project and its state to another place, checked, copied and verified
(``move`` is the verb; ``checks``, ``copy``)."""
