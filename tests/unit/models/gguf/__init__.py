"""Tests of spill.models.gguf."""
