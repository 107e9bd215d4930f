"""Model execution: the model runner (inputs, KV cache, forward, sampling) and its helpers."""
