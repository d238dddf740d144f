"""Layers the model families share: paged attention over the block-table KV cache."""
