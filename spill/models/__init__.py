"""Models: families, names, sources and fingerprints. Engine-free: never imports torch or mlx."""
