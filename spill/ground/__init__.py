"""The ground floor: what every floor above may use and nothing of spill's own beneath it.

``paths`` (where spill keeps things on this machine and in a project), ``hashing`` (the one
file hash), ``sizes`` (memory sizes as people write them), ``machine`` (facts about this machine
and its cache of measurements) and ``validate`` (JSON Schema validation of every document spill
writes and reads).
"""
