"""The model side of the worker: the forward and its layers (packed and fused linears, fused ops,
int8, tensor parallel), the attention hook registered with transformers, and the CPU weight
preparation that swaps them in."""
