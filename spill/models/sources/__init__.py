"""Where a model folder's weights come from, each writing it into the cache with its record:
``hub`` (a pinned commit downloaded), ``staging`` (``--weights <uri>`` copied from shared
storage), ``tiny`` (generated from a seed), ``offline`` (an alias's packaged GGUF imported) and
``quantize`` (spill's own quantized copy of a float model). ``spill.models.resolve`` picks one
for a name; none of them resolves a name."""
