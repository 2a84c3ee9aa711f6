"""Attention: metadata, backends, the paged KV cache."""
