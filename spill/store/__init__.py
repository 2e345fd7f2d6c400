"""The engine-free storage layer: byte access to a state URI (``fs``), tune checkpoints
(``checkpoint``), committed row segments (``rows``), JSON Schema validation (``schemas``) and the
named crash points used by kill drills (``drill``). Nothing here imports torch or mlx.
"""
