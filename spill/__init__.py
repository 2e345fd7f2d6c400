"""spill: causal language models with weights streamed layer by layer from disk.

The package is layered (see STYLE.md): cli -> jobs -> models/store -> engines. Only
``spill.engines.<name>`` imports torch or mlx; everything else stays light so that the CLI
starts fast.
"""

__version__ = "0.1.0"
