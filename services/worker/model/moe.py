"""Mixture-of-experts layers on the CPU: each expert's two products on packed weights.

transformers 5 keeps a sparse block's experts as one module with 3-D weights (``gate_up_proj``
[experts, 2 x intermediate, hidden], ``down_proj`` [experts, hidden, intermediate]; Mixtral,
Qwen2/3-MoE, OLMoE, ...), and its forward takes the router's choice (``top_k_index``,
``top_k_weights``) and runs every expert that was chosen on its tokens through ``F.linear``
over a slice of the 3-D weight, which oneDNN lays out again at every call.

``PackedExperts`` keeps the router and the rest of the block as they are and replaces the
experts module: each expert's gate/up and down products are ``PackedLinear`` layers (the
tiled/AMX kernels where the CPU has them, else oneDNN's packed copy, packed_linear.py), and
the step's (token, expert) pairs are sorted by expert once, so every chosen expert runs one
product per projection on a contiguous slice of rows; each token's weighted outputs are then
summed in expert order, as transformers sums them. A module whose forward this does not
repeat (biases, another activation, interleaved gate/up, gpt-oss's clamped SwiGLU) is left
as it is: the swap is checked against the module it replaces on a probe, as every CPU swap is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from shared import envs

from .packed_linear import PackedLinear, _add_tiled, packing_enabled

log = logging.getLogger("ferry.worker.moe")


class PackedExperts(nn.Module):
    """transformers' 3-D experts module with each expert's products on packed weights (module doc)."""

    def __init__(self, experts: nn.Module, name: str) -> None:
        super().__init__()
        gate_up = getattr(experts, "gate_up_proj").detach()  # noqa: B009 - an nn.Module attribute, untyped
        down = getattr(experts, "down_proj").detach()  # noqa: B009
        self.num_experts = int(gate_up.shape[0])
        self.hidden = int(down.shape[1])
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = getattr(experts, "act_fn")  # noqa: B009
        self.gate_up = nn.ModuleList(_packed(gate_up[e], f"{name}.{e}.gate_up") for e in range(self.num_experts))
        self.down = nn.ModuleList(_packed(down[e], f"{name}.{e}.down") for e in range(self.num_experts))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k
        rows = hidden_states.index_select(0, token_of)
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts[: self.num_experts]):
            if not n:
                continue
            gate, up = self.gate_up[e](rows[start: start + n]).chunk(2, dim=-1)
            out[start: start + n] = self.down[e](self.act_fn(gate) * up)
            start += n
        out = out * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(1).to(out.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token_of, out)


def _packed(weight: torch.Tensor, name: str) -> PackedLinear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight)
    packed = PackedLinear(linear)
    _add_tiled(packed, linear.weight, None, name)
    return packed


def _replaceable(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and gate_up.shape[0] == down.shape[0] and gate_up.shape[1] == 2 * down.shape[2]
            and gate_up.shape[2] == down.shape[1] and callable(getattr(module, "act_fn", None))
            and not any(n.endswith("bias") for n, _ in module.named_parameters()))


def pack_experts(body: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Replace every replaceable experts module under ``body`` (module doc); the count replaced.

    Each replacement is checked on a probe (tokens routed to every expert, some to several):
    within a bfloat16 step of the module it replaces in bfloat16, within float32 summation
    order in float32; a module that fails is kept, logged."""
    if not packing_enabled(dtype, device) or not envs.CPU_PACKED_EXPERTS.get():
        return 0
    swapped = 0
    for parent in list(body.modules()):
        for name, child in list(parent.named_children()):
            if not _replaceable(child) or child.gate_up_proj.dtype != dtype:
                continue
            packed = PackedExperts(child, name)
            if not _agrees(child, packed, dtype):
                log.warning("packed experts %s differ from transformers' module on a probe; left as they are", name)
                continue
            setattr(parent, name, packed)
            swapped += 1
    return swapped


def _agrees(original: nn.Module, packed: PackedExperts, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    tokens, k = 2 * packed.num_experts + 3, min(2, packed.num_experts)
    x = torch.randn(tokens, packed.hidden, generator=gen).to(dtype)
    index = torch.stack([torch.arange(tokens) % packed.num_experts,
                         (torch.arange(tokens) * 7 + 1) % packed.num_experts], dim=1)[:, :k]
    weights = torch.rand(tokens, k, generator=gen).to(dtype)
    with torch.inference_mode():
        want = original(x, index, weights).float()
        got = packed(x, index, weights).float()
    step = 2.0**-7 if dtype == torch.bfloat16 else 1e-5  # one bfloat16 step, or float32 summation order
    return bool(torch.all((got - want).abs() <= step * (want.abs() + float(want.abs().max())) + 1e-6))

