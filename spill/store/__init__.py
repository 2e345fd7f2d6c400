"""The engine-free storage layer: byte access to a state URI (``fs``), conditional writes
(``cas``: local, memory and object stores), the safetensors byte format (``safetensors_io``),
destination probes (``probe``), snapshots (``snapshot``) and the named crash points used by
kill drills (``drill``). It imports nothing of spill but the ground floor.
"""
