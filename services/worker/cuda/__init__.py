"""CUDA-only parts of the worker: decode-step graphs and the one pinned host-to-device copy per step."""
