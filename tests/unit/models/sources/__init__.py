"""Tests of spill.models.sources."""
