"""Triton kernels for the paged KV cache: K/V store and unified (prefill + decode) attention.

Importing a submodule imports triton; `tinyvllm.attention.triton_attn` does so only when the
Triton backend is chosen, so CPU-only installs never need it.
"""
