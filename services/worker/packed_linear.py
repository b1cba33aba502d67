"""Linear layers with their weights pre-packed for oneDNN, on the CPU.

``F.linear`` on the CPU hands every call's weight to the BLAS in its plain row-major
layout, which the library re-blocks internally each time. oneDNN can take the weight
once, reordered into the blocked layout its kernels read (``mkldnn._reorder_linear_weight``),
and multiply against that on every call (``mkldnn._linear_pointwise``): the same
products, in the same order for bfloat16 (bit-identical outputs, checked at start-up and
in tests/unit/test_packed_linear.py), and 1.05-1.1x faster at prefill sizes, 1.2-1.4x at
a decode batch of 64 and 1.3-2.9x for a single decode on this model's shapes
(docs/benchmarks.md, "CPU worker speed"). PyTorch's inductor does the same when it
freezes a model for the CPU.

Projections that read the same input are also fused into one product
(``fuse_projections``): q/k/v of every attention and gate/up of every MLP, as vLLM's
``QKVParallelLinear`` and ``MergedColumnParallelLinear`` do. transformers' model code
still calls ``q_proj``, ``k_proj`` and ``v_proj`` one after the other; here ``q_proj``
computes all three outputs in one oneDNN call and hands ``k_proj`` and ``v_proj`` theirs
(``FusedHead`` / ``FusedPart``). One product of width 960 instead of 576 + 192 + 192
and one of 3,072 instead of 2 x 1,536 ran 1.2-1.3x faster at every batch size measured.

bfloat16 decode steps of 1-8 rows go to a kernel of ferry's own where the CPU has
AVX512-BF16 (``csrc/small_batch_linear.cpp``, ``_add_small_batch``): at a few rows a product
is a read of its weight, and oneDNN's blocked kernels read it at 13.5-20 GB/s where the
small-batch kernel's one stream per thread reads ~29 (a decode step at batch 1 0.55x the
time, at batch 8 0.77x; docs/benchmarks.md, "Decode at low concurrency"). It holds a second
copy of each weight and sums in another order, so those rows are within one bfloat16 step of
oneDNN's, not bit for bit; ``FERRY_CPU_SMALL_BATCH_LINEAR=0`` turns it off.

float32 too: there oneDNN's kernels sum in another order than MKL's (differences ~1e-5
relative on these shapes), so logits are no longer bit-identical to transformers', but
greedy outputs stayed token-identical (SmolLM2-135M: 50 of 50 chat prompts x 64 tokens;
the token-exact tests pass) and the common load ran 1.2x faster, on AVX2 too
(docs/benchmarks.md, "float32 as fast as bfloat16's path"). ``FERRY_CPU_FLOAT32_EXACT=1``
keeps float32 on ``F.linear`` (and on transformers' own element-wise ops and SDPA for
prompts: ``float32_exact``); ``FERRY_CPU_PACKED_LINEAR=0`` turns packing off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("ferry.worker.packed_linear")

BATCH_HINT = 64  # the M oneDNN picks its layout for; measured best or near-best from M=1 to 2048
SMALL_BATCH_ROWS = 8  # at most this many rows go to the small-batch kernel (_add_small_batch)


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed weight (the plain weight is dropped)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

        self.tiles: torch.Tensor | None
        self.register_buffer("tiles", None, persistent=False)  # the small-batch copy (add_small_batch), when on
        self._small: Callable[..., torch.Tensor] | None = None
        self._bias32 = torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._small is not None and 0 < x.numel() <= SMALL_BATCH_ROWS * self.in_features and x.is_contiguous():
            return self._small(x, self.tiles, self._bias32)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def add_small_batch(self, weight: torch.Tensor, kernels: Any) -> None:
        """Keep a copy of ``weight`` laid out for the small-batch kernel and send inputs of
        up to ``SMALL_BATCH_ROWS`` rows to it (csrc/small_batch_linear.cpp)."""
        self.tiles = kernels.small_batch_pack(weight.detach())
        self._bias32 = torch.empty(0) if self.bias is None else self.bias.detach().float().contiguous()
        self._small = kernels.small_batch_linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


class FusedHead(nn.Module):
    """The first projection of a fused group: one product for the whole group, its own slice returned.

    Its followers (``FusedPart``) are called next on the same input and take their slices
    of that product; a follower called on any other tensor is a change in the model's
    code that this shim cannot follow, so it fails loudly instead of returning a stale slice.
    """

    def __init__(self, fused: nn.Module, sizes: list[int]) -> None:
        super().__init__()
        self.fused = fused
        self.sizes = sizes
        self.in_features = getattr(fused, "in_features", None)
        self.out_features = sizes[0]
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._parts = torch.split(self.fused(x), self.sizes, dim=-1)
        self._input = x
        return self._parts[0]

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input:
            raise RuntimeError("a fused projection was called on another input than its group's first")
        part = self._parts[index]
        if index == len(self.sizes) - 1:  # the group is complete: drop the references
            self._input, self._parts = None, ()
        return part


class FusedPart(nn.Module):
    def __init__(self, head: FusedHead, index: int) -> None:
        super().__init__()
        self._head = [head]  # a list: not a registered submodule (the head is already one)
        self.index = index
        self.out_features = head.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._head[0].take(self.index, x)


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fuse_projections(module: nn.Module, dtype: torch.dtype, device: torch.device,
                     make: Callable[[nn.Linear, nn.Module], nn.Module] | None = None) -> int:
    """Fuse each q/k/v and gate/up group of plain ``nn.Linear`` layers; the groups fused.

    The joined layer is ``make(joined, first_of_group)`` (``--quantization int8``: an
    ``Int8Linear``), by default a ``PackedLinear`` where packing applies. A packed group
    must compute bit for bit what ``F.linear`` computed for each layer; a group from
    ``make`` (which rounds on purpose) within 10 % of the largest output, on a probe. In
    float32 a packed group may differ from the separate products by summation order
    (1e-5 of the largest output at most).
    """
    if make is None and not packing_enabled(dtype, device):
        return 0
    fused = 0
    for parent in list(module.modules()):
        for names in FUSED_GROUPS:
            found = [getattr(parent, n, None) for n in names]
            layers = [m for m in found if type(m) is nn.Linear and m.weight.dtype == dtype]
            if len(layers) != len(names):
                continue
            if len({m.in_features for m in layers}) != 1 or len({m.bias is None for m in layers}) != 1:
                continue
            first = layers[0]
            joined = nn.Linear(first.in_features, sum(m.out_features for m in layers), bias=first.bias is not None,
                               device=first.weight.device, dtype=dtype)
            with torch.no_grad():
                joined.weight.copy_(torch.cat([m.weight for m in layers]))
                if first.bias is not None:
                    joined.bias.copy_(torch.cat([m.bias for m in layers]))
            try:
                inner: nn.Module = PackedLinear(joined) if make is None else make(joined, first)
            except RuntimeError as exc:
                log.warning("linear packing unavailable (%s); projections left unfused", exc)
                return fused
            head = FusedHead(inner, [m.out_features for m in layers])
            probe = torch.randn(3, first.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
            outs = head(probe), *(FusedPart(head, i)(probe) for i in range(1, len(layers)))
            alone = [F.linear(probe, m.weight, m.bias) for m in layers]
            same = _near if make is not None else _order_only if dtype == torch.float32 else torch.equal
            if not all(same(o, a) for o, a in zip(outs, alone, strict=True)):
                log.warning("fused %s differ from separate products; left unfused", "/".join(names))
                continue
            setattr(parent, names[0], head)
            for i, n in enumerate(names[1:], start=1):
                setattr(parent, n, FusedPart(head, i))
            fused += 1
            if isinstance(inner, PackedLinear):
                _add_small_batch(inner, joined.weight, joined.bias, "/".join(names))
    return fused


def _near(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a.float() - b.float()).abs().max() <= 0.1 * b.float().abs().max())


def _order_only(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float32 products that differ only as another summation order makes them differ."""
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max())


def float32_exact() -> bool:
    """``FERRY_CPU_FLOAT32_EXACT=1``: float32 computed by the ops transformers' forward runs
    (``F.linear``, its RMSNorm, rotary and SiLU code, SDPA for prompts), as ferry computed
    float32 before these paths; for A/B runs against transformers. Off by default: packed
    linears, fused ops and the prompt kernel sum in another order (~1e-5 relative)."""
    return os.environ.get("FERRY_CPU_FLOAT32_EXACT", "0").strip().lower() in ("1", "true", "yes", "on")


def fast_cpu_dtype(dtype: torch.dtype) -> bool:
    """The dtypes the CPU fast paths (packing, fused ops, the prompt kernel) compute:
    bfloat16, and float32 unless ``FERRY_CPU_FLOAT32_EXACT=1``."""
    return dtype == torch.bfloat16 or (dtype == torch.float32 and not float32_exact())


def packing_enabled(dtype: torch.dtype, device: torch.device) -> bool:
    setting = os.environ.get("FERRY_CPU_PACKED_LINEAR", "1").strip().lower()
    if device.type != "cpu" or setting in ("0", "false", "no", "off"):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    return fast_cpu_dtype(dtype)


def pack_linears(module: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Swap every plain ``nn.Linear`` under ``module`` for a ``PackedLinear``; the count swapped.

    A layer whose packed product is not bit-identical to ``F.linear`` on a probe input
    (bfloat16) stays as it is, so a oneDNN that disagrees costs speed, never correctness.
    """
    if not packing_enabled(dtype, device):
        return 0
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.dtype != dtype:
                continue
            try:
                packed = PackedLinear(child)
                if dtype == torch.bfloat16:
                    probe = torch.randn(3, child.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
                    if not torch.equal(packed(probe), F.linear(probe, child.weight, child.bias)):
                        log.warning("packed %s differs from F.linear; left unpacked", name)
                        continue
            except RuntimeError as exc:  # a oneDNN build without this op or dtype
                log.warning("linear packing unavailable (%s); using F.linear", exc)
                return swapped
            setattr(parent, name, packed)
            swapped += 1
            _add_small_batch(packed, child.weight, child.bias, name)
    return swapped


def small_batch_enabled(dtype: torch.dtype) -> bool:
    """``FERRY_CPU_SMALL_BATCH_LINEAR=0`` keeps every product on oneDNN (for A/B runs)."""
    setting = os.environ.get("FERRY_CPU_SMALL_BATCH_LINEAR", "1").strip().lower()
    return dtype == torch.bfloat16 and setting not in ("0", "false", "no", "off")


def _small_batch_kernels() -> Any | None:
    try:
        from .backends.cpu_paged import load_extension

        ext = load_extension()
    except Exception:  # noqa: BLE001 - no compiler, a failed build: oneDNN alone
        return None
    return ext if ext.small_batch_linear_available() else None


def _add_small_batch(packed: PackedLinear, weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> bool:
    """Give a bfloat16 ``PackedLinear`` its small-batch path, where the CPU has AVX512-BF16.

    Decode steps of 1-8 rows read the whole weight for little arithmetic; oneDNN's packed
    kernels streamed it at 16-17.6 GB/s on the Zen 4 EPYC, the small-batch kernel at ~28
    (docs/benchmarks.md, "Decode at low concurrency"). It sums in another order than oneDNN,
    so it is held to the same product within a bfloat16 step on a probe, not bit for bit.
    Costs a second copy of the weight (SmolLM2-135M: 212 MB for the body, 57 for the LM head).
    """
    if not small_batch_enabled(weight.dtype) or packed.out_features % 16 or packed.in_features % 2:
        return False
    kernels = _small_batch_kernels()
    if kernels is None:
        return False
    packed.add_small_batch(weight, kernels)
    probe = torch.randn(5, packed.in_features, generator=torch.Generator().manual_seed(1)).to(weight.dtype)
    want = F.linear(probe.float(), weight.float(), None if bias is None else bias.float())
    got = packed(probe).float()
    if not bool(torch.all((got - want).abs() <= want.abs() * 2.0**-7 + 1e-3 * want.abs().max())):
        log.warning("small-batch %s differs from its float32 product; oneDNN alone", name)
        packed.tiles, packed._small = None, None
        return False
    return True

