"""RMSNorm for ``--deterministic`` on a GPU: one Triton program per row.

PyTorch's CUDA reductions choose how many threads, and at few rows how many blocks, share a
row's sum from the shape of the whole tensor, so transformers' ``hidden.pow(2).mean(-1)``
sums a token's row in another order at batch 1 than at batch 64. Here each row is one
program that loads the whole row (``BLOCK``, the hidden size rounded up to a power of two)
and reduces it with ``tl.sum``: the same tree for every row at any row count. The
arithmetic is transformers' Llama RMSNorm (float32 mean of squares, ``rsqrt(var + eps)``, the
result rounded to the input's dtype, then times the weight in that dtype).

Only the norm classes whose forward is exactly that formula are replaced
(``INVARIANT_NORMS``); a model with another norm on a GPU is refused by name under
``--deterministic`` (``make_norms_batch_invariant``). Runs compiled on CUDA and, in the tests,
under Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

# transformers' RMSNorm classes that compute weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)
INVARIANT_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = (x * (1.0 / tl.sqrt(var + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over x's last dimension, row by row."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    n_rows, n_cols = flat.shape
    if n_rows:
        _rms_norm_kernel[(n_rows,)](flat, weight.to(x.dtype), out, flat.stride(0), out.stride(0), n_cols, float(eps),
                                    BLOCK=triton.next_power_of_2(n_cols))
    return out.view(x.shape)


class InvariantRMSNorm(nn.Module):
    """A transformers RMSNorm (``INVARIANT_NORMS``) computed by ``rms_norm_rows``."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        weight = norm.weight
        assert isinstance(weight, torch.Tensor)
        self.weight = weight
        self.variance_epsilon = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_rows(x, self.weight, self.variance_epsilon)


def make_norms_batch_invariant(model: nn.Module) -> int:
    """Replace every RMSNorm of ``model`` in place; refuse (ValueError, by name) a model with a
    norm this module has no batch-invariant kernel for. Returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if kind in INVARIANT_NORMS:
                setattr(parent, name, InvariantRMSNorm(child))
                replaced += 1
            elif "norm" in kind.lower() and kind != "InvariantRMSNorm":
                raise ValueError(f"--deterministic on a GPU: no batch-invariant kernel for {kind} (this model's "
                                 f"{type(model).__name__}); the ones ferry has: {', '.join(sorted(INVARIANT_NORMS))}")
    return replaced
