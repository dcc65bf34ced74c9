"""Training backends: the torch backend (transformers model + AdamW) and its torch_dist checkpoints."""
