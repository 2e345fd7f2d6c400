"""spill's own engine machinery, written once and engine-free (never imports torch or mlx).

``ring`` streams decoder layers through K slots; ``model`` walks a kernel's layers through the
ring once per forward; ``runner`` is the KV-cached generate/score bookkeeping; ``train`` the save-forward / recompute-backward LoRA walk and trainer state;
``open`` the order of decisions at open; ``numerics`` the measured bf16 choice; ``reader`` the
positioned reads of safetensors shards; ``common`` the plans, checks and numpy bookkeeping.
Each engine supplies a ``kernel.Kernel`` (a handful of array primitives), ``ring.Hooks`` and its
model families; that is all an engine is.
"""
