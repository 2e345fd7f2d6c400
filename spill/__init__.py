"""spill: causal language models with weights streamed layer by layer from disk.

The package is layered, imports pointing down only (``tests/unit/test_structure.py`` holds the
table): cli > examples > project > jobs > payloads > control > store, and jobs > engines >
models > store, all on the ground floor (errors, paths, hashing, sizes, console, machine,
validate). Only ``spill.engines.<name>`` imports torch or mlx; everything else stays light so
that the CLI starts fast.
"""

__version__ = "0.1.0"
