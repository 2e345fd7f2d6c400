"""llama.cpp's GGUF files: ``reader`` (a bounded parser: metadata, tensor table, one tensor at a
time, the tokenizer), ``arch`` (the architectures spill reads and writes, one table both ways),
``quant`` (ggml's quantized blocks as spill's affine groups, without loss) and ``importer`` (a
GGUF as an HF-layout model folder in the cache). The exporter (``spill.jobs.export.gguf``) reads
``arch`` and ``reader``'s public tables."""
