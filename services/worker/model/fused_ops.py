"""Fused element-wise ops on the CPU (bfloat16 and float32): RMSNorm, rotary embedding, SiLU-and-mul.

transformers writes each of these as a chain of small PyTorch ops (RMSNorm: a float32
copy, pow, mean, add, rsqrt, two multiplies and a copy back; RoPE: four multiplies,
two negations, two concatenations and two adds; the MLP's ``act_fn(gate) * up``), each
a pass over memory. On the common load they took ~2.3 s of a 17.5 s run, more than
the attention (docs/benchmarks.md, "Where a prompt step goes"). The kernels in
``services/kernels/csrc/fused_ops.cpp`` do each in one pass and, in bfloat16, round to bfloat16
where PyTorch stores a bfloat16 tensor:

- rotary embedding: bit-identical to ``apply_rotary_pos_emb`` in bfloat16;
- RMSNorm: its float32 mean of squares is summed in another order, so an output can
  differ from transformers' by one bfloat16 step (rarely);
- SiLU-and-mul: its exponential differs from PyTorch's in the last float32 bits; same.

In float32 the rotary embedding is bit-identical too and the other two differ by a few
float32 ulps. Each swap is checked at start-up against the code it replaces on a
random probe (equal for the rotary embedding; within one bfloat16 step, or 1e-5 of the
largest output in float32, for the other two) and skipped when the check fails, so a model
whose code differs costs speed, never correctness.

Only on the CPU, in bfloat16 or float32 (not with ``FERRY_CPU_FLOAT32_EXACT=1``), with
the compiled kernels (AVX-512 intrinsics, or portable loops elsewhere), and only for the
model code they were written against (Llama, Mistral, Qwen2, Qwen3: the same RMSNorm, MLP and rotary
function). ``FERRY_CPU_FUSED_OPS=0`` turns them off.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from services.kernels import ops
from shared import envs

from .packed_linear import FusedHead, FusedPart, PackedLinear, fast_cpu_dtype

log = logging.getLogger("ferry.worker.fused_ops")

NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}
SILU = {"SiLU", "SiLUActivation"}


def fused_ops_enabled(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not envs.CPU_FUSED_OPS.get():
        return False
    return fast_cpu_dtype(dtype)


def kernels() -> ops.CpuKernels | None:
    """The compiled ops, or None (no compiler)."""
    try:
        ext = ops.load()
    except Exception as exc:  # noqa: BLE001 - no compiler, a failed build: the model stays as it is
        log.warning("fused CPU ops unavailable (%s)", exc)
        return None
    return ext if ext.fused_ops_available() else None


FUSED_DTYPES = (torch.bfloat16, torch.float32)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """bfloat16: equal up to one bfloat16 step (relative 2^-7) element by element; float32:
    within 1e-5 of the largest element (another summation order, another exponential)."""
    a32, b32 = a.float(), b.float()
    if b.dtype == torch.float32:
        return bool((a32 - b32).abs().max() <= 1e-5 * b32.abs().max())
    return bool(torch.all((a32 - b32).abs() <= b32.abs() * 2.0**-7 + 1e-6))


class FusedRMSNorm(nn.Module):
    """LlamaRMSNorm in one pass; anything but a contiguous CPU input of the weight's dtype takes the original."""

    def __init__(self, original: nn.Module, kernels: ops.CpuKernels) -> None:
        super().__init__()
        weight = original.weight
        assert isinstance(weight, torch.Tensor)
        self.weight = weight
        self.variance_epsilon = float(getattr(original, "variance_epsilon"))  # noqa: B009 - typed as Any
        self._original = [original]  # not a submodule: its weight is this module's
        self._kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is self.weight.dtype and x.device.type == "cpu" and x.is_contiguous() and x.shape[-1] % 16 == 0:
            return self._kernels.rms_norm(x, self.weight, self.variance_epsilon)
        return self._original[0](x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused"


class FusedSiluMLP(nn.Module):
    """``down(silu(gate) * up)`` over the fused gate/up product, the activation in one pass.

    Where the gate/up layer is on the tiled bfloat16 kernel (packed_linear.py), the
    activation is applied to the kernel's accumulators before anything is stored
    (``tiled_silu_linear``: the same bits as the product followed by ``silu_and_mul``), so
    the [tokens, 2 x intermediate] product is never written and read back: ~7 % of a
    2,048-token prompt step on SmolLM2-135M (docs/benchmarks.md, "Kernels: linear
    products (AMX, tiled, oneDNN)").
    """

    def __init__(self, gate_up: nn.Module, down_proj: nn.Module, intermediate: int, kernels: ops.CpuKernels) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down_proj = down_proj
        self.intermediate = intermediate
        self._kernels = kernels
        self._gated: Callable[..., torch.Tensor] | None = None
        self._amx_gated: Callable[..., torch.Tensor] | None = None  # past tiled_rows, up to gate_up.amx_rows
        if (isinstance(gate_up, PackedLinear) and gate_up.tiles is not None and gate_up.out_features == 2 * intermediate
                and intermediate % 16 == 0):
            self._gated = getattr(kernels, "tiled_silu_linear", None)
            if gate_up.amx_rows:
                self._amx_gated = getattr(kernels, "amx_silu_linear", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up
        if self._gated is not None and isinstance(gu, PackedLinear) and gu.tiles is not None:
            n = x.numel()
            if n <= gu.tiled_rows * gu.in_features:
                return self.down_proj(self._gated(x if x.is_contiguous() else x.contiguous(), gu.tiles, gu._bias32))
            if self._amx_gated is not None and n <= gu.amx_rows * gu.in_features:
                return self.down_proj(self._amx_gated(x if x.is_contiguous() else x.contiguous(), gu.tiles, gu._bias32))
        return self.down_proj(self._kernels.silu_and_mul(gu(x)))


def _rotary(original: Callable[..., Any], kernels: ops.CpuKernels) -> Callable[..., Any]:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             *args: Any, **kwargs: Any) -> Any:
        # ferry's forward: batch 1, [1, heads, tokens, head_dim] views, cos/sin [1, tokens, head_dim]
        # (the patch is per code module, so a float32 model in a process that also runs
        # FERRY_CPU_FLOAT32_EXACT=1 is checked at each call)
        if (not args and kwargs.get("unsqueeze_dim", 1) == 1 and fast_cpu_dtype(q.dtype) and k.dtype is q.dtype
                and cos.dtype is q.dtype and sin.dtype is q.dtype and q.device.type == "cpu" and q.dim() == 4 and q.shape[0] == 1
                and k.dim() == 4 and k.shape[0] == 1 and cos.dim() == 3 and cos.shape[0] == 1
                and cos.shape[1:] == (q.shape[2], q.shape[3]) and sin.shape == cos.shape
                and q.shape[3] % 32 == 0 and q.stride(3) == 1 and k.stride(3) == 1):
            qo, ko = kernels.rotary(q[0].transpose(0, 1), k[0].transpose(0, 1), cos[0].contiguous(),
                                    sin[0].contiguous())
            return qo.transpose(0, 1).unsqueeze(0), ko.transpose(0, 1).unsqueeze(0)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.ferry_fused = True  # type: ignore[attr-defined]
    apply_rotary_pos_emb.ferry_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _probe(*shape: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _patch_rotary(module_name: str, kernels: Any, head_dim: int) -> bool:
    """Swap ``apply_rotary_pos_emb`` in the model's code module for the fused one, if it checks out."""
    mod = sys.modules.get(module_name)
    original = getattr(mod, "apply_rotary_pos_emb", None)
    if mod is None or original is None:
        return False
    if getattr(original, "ferry_fused", False):
        return True
    if head_dim % 32:
        return False
    fused = _rotary(original, kernels)
    tokens, heads, kv_heads = 7, 4, 2
    for dtype in FUSED_DTYPES:
        qkv = _probe(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)  # q, k: views of one product
        q = qkv[:, : heads * head_dim].view(1, tokens, heads, head_dim).transpose(1, 2)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(1, tokens, kv_heads, head_dim).transpose(1, 2)
        angles = torch.rand(1, tokens, head_dim // 2, generator=torch.Generator().manual_seed(1)) * 6.28
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        want, got = original(q, k, cos, sin), fused(q, k, cos, sin)
        if not all(torch.equal(w, g) for w, g in zip(want, got, strict=True)):
            log.warning("fused rotary embedding differs from %s's in %s; left as it is", module_name, dtype)
            return False
    mod.apply_rotary_pos_emb = fused  # type: ignore[attr-defined]
    return True


def fuse_elementwise(model: nn.Module, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """Swap RMSNorms, SiLU MLPs and the rotary embedding for fused kernels; the counts swapped."""
    counts = {"rms_norm": 0, "silu_mlp": 0, "rotary": 0}
    if not fused_ops_enabled(dtype, device):
        return counts
    ops = kernels()
    if ops is None:
        return counts
    rotary_modules: dict[str, int] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            weight = getattr(child, "weight", None)
            fused: nn.Module | None = None
            if kind in NORMS and isinstance(weight, torch.Tensor) and hasattr(child, "variance_epsilon"):
                if weight.dtype in FUSED_DTYPES and weight.shape[-1] % 16 == 0:
                    fused, key, width = FusedRMSNorm(child, ops), "rms_norm", weight.shape[-1]
            elif kind in MLPS and _fusable_mlp(child):
                head, down = child.gate_proj, child.down_proj
                assert isinstance(head, FusedHead) and isinstance(down, nn.Module)
                fused, key, width = FusedSiluMLP(head.fused, down, head.sizes[0], ops), "silu_mlp", head.in_features or 0
            if fused is not None:
                x = _probe(5, width, dtype=dtype) * 3
                with torch.inference_mode():
                    same = _close(fused(x), child(x))
                if same:
                    setattr(parent, name, fused)
                    counts[key] += 1
                else:
                    log.warning("fused %s differs from %s; left as it is", key, kind)
            head_dim = getattr(child, "head_dim", None)
            if hasattr(child, "q_proj") and isinstance(head_dim, int):
                rotary_modules[type(child).__module__] = head_dim
    for module_name, head_dim in rotary_modules.items():
        counts["rotary"] += int(_patch_rotary(module_name, ops, head_dim))
    return counts


def _fusable_mlp(mlp: nn.Module) -> bool:
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    act = getattr(mlp, "act_fn", None)
    return (isinstance(gate, FusedHead) and isinstance(up, FusedPart) and len(gate.sizes) == 2
            and gate.sizes[0] == gate.sizes[1] and gate.sizes[0] % 16 == 0 and type(act).__name__ in SILU
            and gate.in_features is not None)
