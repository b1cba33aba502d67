"""The model worker: weights, the paged KV cache, the forward pass and sampling (docs/worker.md)."""
