"""Batch-invariant linear layers for ``--deterministic`` (docs/api.md, "Deterministic outputs").

A token's numbers must not depend on the other tokens computed in the same step. Element-wise
ops and the row-wise ones (RMSNorm, RoPE, the activations, the sampler's per-row reductions)
already compute each row alone; matrix products do not: a BLAS picks its blocking of the
reduction (K) dimension, and on the GPU a split-K, from the shape of the whole call, so one
row's sums change with the number of rows beside it (measured here with oneDNN and MKL in
float32 and bfloat16: tests/unit/worker/test_batch_invariant.py). Two ways out:

- ferry's own CPU kernels (``tiled_linear``, ``amx_linear``) sum a row the same way at any row
  count, so a layer that has them takes every row count on one of them
  (``PackedLinear.make_batch_invariant``);
- every other product runs in calls of exactly ``FIXED_ROWS`` rows (the last padded with zero
  rows), so each call has one shape and each row's sums are those of that shape, wherever the
  row sits in the call (``packed_linear.in_fixed_rows``, ``FixedRowsLinear``).

The attention side is ``backends.base.as_decodes``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .packed_linear import in_fixed_rows

# Rows per product call. On the CPU a decode step of one request then pays for 16 rows of
# arithmetic over a weight it reads once either way; on a GPU 64 rows still fit one tile row of
# the usual GEMM kernels.
FIXED_ROWS = {"cpu": 16, "cuda": 64}


def fixed_rows_for(device: torch.device) -> int:
    return FIXED_ROWS.get(device.type, 64)


class FixedRowsLinear(nn.Module):
    """An ``nn.Linear`` whose products run in calls of exactly ``rows`` rows."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        self.linear = linear
        self.rows = rows

    @property
    def weight(self) -> torch.Tensor:  # code that reads the layer's weight (tied heads, dtype probes)
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.linear.weight, self.linear.bias
        return in_fixed_rows(lambda rows: F.linear(rows, weight, bias), x, self.rows)

    def extra_repr(self) -> str:
        return f"rows={self.rows}"


def make_linears_batch_invariant(model: nn.Module, device: torch.device) -> tuple[Counter[str], dict[int, nn.Module]]:
    """Every linear layer of ``model`` batch-invariant, in place. Returns how many took which way,
    and the replacement of each plain ``nn.Linear`` by the id of the layer it replaced (a caller
    that holds a layer, as the runner holds the LM head, looks its own up there)."""
    rows = fixed_rows_for(device)
    ways: Counter[str] = Counter()
    replaced: dict[int, nn.Module] = {}
    seen: set[int] = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if hasattr(child, "make_batch_invariant"):  # PackedLinear, RowParallelLinear
                if id(child) not in seen:
                    seen.add(id(child))
                    make = cast(Callable[[int], str], child.make_batch_invariant)
                    ways[make(rows)] += 1
            elif type(child) is nn.Linear:  # subclasses are not taken
                if id(child) not in replaced:
                    replaced[id(child)] = FixedRowsLinear(child, rows)
                    ways[f"{device.type} BLAS in {rows}-row calls"] += 1
                setattr(parent, name, replaced[id(child)])
    return ways, replaced
