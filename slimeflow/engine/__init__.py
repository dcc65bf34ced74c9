"""The embedded rollout engine: SGLang's native HTTP API over a transformers causal LM, with continuous batching."""
