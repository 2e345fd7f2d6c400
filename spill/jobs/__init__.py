"""Jobs: run, tune, distill, eval. Engine-free: they talk to an engine through its boundary."""
