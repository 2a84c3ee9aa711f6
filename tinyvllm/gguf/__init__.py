"""GGUF checkpoints: metadata -> HF config/tokenizer, tensor names -> our parameters,
block formats -> torch tensors (parsed as data with the `gguf` package, never executed)."""
