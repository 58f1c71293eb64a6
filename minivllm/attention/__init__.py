"""Attention backends: how a flattened batch attends over the paged KV cache (chapter 06)."""
