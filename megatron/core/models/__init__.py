"""Models assembled from megatron.core.transformer building blocks."""
