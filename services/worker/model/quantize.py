"""``--quantization int8``: the decoder's linear layers as int8 weights x int8 activations
(W8A8), through PyTorch's own int8 products: oneDNN's prepacked int8 linear
(``torch.ops.onednn.qlinear_pointwise``, what PyTorch's x86 int8 quantization lowers to;
AMX-INT8 or VNNI kernels) where this torch has it, else ``torch._int_mm``.

- Weights: quantized once at load, symmetric, one scale per output channel (row).
- Activations: quantized at every call, symmetric, one scale per token (row), so a
  token with large activations does not crush every other token's resolution. This is
  what vLLM's dynamic per-token int8 does; PyTorch's ``quantize_dynamic`` (this module's
  first version) takes one scale for the whole step, which cost SmolLM2-135M 3.2x in
  perplexity (docs/benchmarks.md, "int8 weights").
- The products accumulate in int32 and are scaled back to the model's dtype (bfloat16
  or float32), so norms, attention, the KV cache and the LM head stay as they are. The
  LM head is left unquantized: on SmolLM2 it adds as much perplexity as the whole body.

Speed: int8 products run at about twice the bfloat16 rate on a CPU with AVX512-VNNI
(~860 against ~430 GOP/s on this model's shapes on 2 cores), and read half the bytes. On
a Xeon with AMX, oneDNN's prepacked kernel ran them 1.5-3x faster than ``torch._int_mm`` at
512-2,048 rows (3.5-4.9 TOPS on 2 cores) and took the common load from 692 to ~860 output
tok/s; ferry's bfloat16 AMX path is still faster there (docs/benchmarks.md, "int8 weights").
Quantizing each step's activations and scaling the int32 results back are two passes
over memory; the CPU kernels' ``quant_rows``/``dequant_rows`` do each in one pass
(bit-identical to the PyTorch ops below, which are the fallback without a compiler).
CPU only, opt-in; its quality cost is measured by ``services.engine.bench_quality``.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from typing import Any

import torch
from torch import nn

from services.kernels import ops
from shared import envs

log = logging.getLogger("ferry.worker.quantize")

MIN_AMAX = 1e-10  # an all-zero row still gets a finite scale
SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength: half of each channel's range moves to the weight
CALIBRATION_TOKENS = 512


def quantize_weight(weight: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 [out, in], float32 scale [out]), one scale per output
    channel, values in [-qmax, qmax] (``int8_weight_max()``: 63 where the CPU's int8
    products would saturate on full-range weights)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=MIN_AMAX) / qmax
    return torch.round(w / scale[:, None]).clamp(-qmax, qmax).to(torch.int8), scale


def quant_rows_torch(x: torch.Tensor, inv_smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, k] -> (int8 [rows, k], float32 scale [rows]): what the kernel's ``quant_rows`` computes."""
    xs = x.float() if inv_smooth is None else x.float() * inv_smooth
    scale = xs.abs().amax(dim=1).clamp(min=MIN_AMAX) / 127
    return torch.round(xs / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def dequant_rows_torch(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                       bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """int32 [rows, n] -> ``dtype``: (acc * row_scale) * col_scale (+ bias), rounded once."""
    y = acc.float() * row_scale[:, None] * col_scale
    if bias is not None:
        y = y + bias
    return y.to(dtype)


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights and per-token int8 activations (W8A8, dynamic).

    ``input_absmax`` (per input channel, from ``calibrate``) turns on SmoothQuant's
    rescaling: input channel j is divided by s_j = absmax_j^a / max|W[:, j]|^(1-a) before
    quantizing and the weight's column j multiplied by it, the product unchanged in exact
    arithmetic, so a few outlier channels no longer set every token's scale.
    """

    qweight: torch.Tensor
    weight_scale: torch.Tensor
    inv_smooth: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, kernels: ops.CpuKernels | None = None, input_absmax: torch.Tensor | None = None,
                 alpha: float = SMOOTH_ALPHA, onednn: bool | None = None,
                 stored: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``onednn``: the products on oneDNN's prepacked kernel (None: where ``onednn_int8()``).
        ``stored``: a W8A8 checkpoint's own (int8 [out, in], scale [out]) (checkpoint_quant.py),
        taken as they are instead of quantizing ``linear``'s weight."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        inv_smooth = None
        if stored is not None:
            qweight, scale = stored[0].to(torch.int8).contiguous(), stored[1].float().reshape(-1).contiguous()
            if tuple(qweight.shape) != (self.out_features, self.in_features) or scale.numel() != self.out_features:
                raise ValueError(f"stored int8 weight {tuple(qweight.shape)} / {scale.numel()} scales do not fit "
                                 f"a {self.in_features} -> {self.out_features} layer")
        else:
            weight = linear.weight.detach().float()
            if input_absmax is not None:
                s = (input_absmax.float().clamp(min=1e-5) ** alpha / weight.abs().amax(dim=0).clamp(min=1e-5) ** (1 - alpha))
                s = s.clamp(min=1e-5)
                weight = weight * s
                inv_smooth = (1 / s).contiguous()
            qweight, scale = quantize_weight(weight, int8_weight_max())
        # oneDNN's prepacked int8 product where this torch has it (onednn_int8()): the buffer is
        # then oneDNN's own layout of the same bytes (an opaque tensor), and its results are the
        # same integers as torch._int_mm's, as float32. Else [out, in]: torch._int_mm reads its
        # transpose fastest.
        self._onednn = onednn_int8() if onednn is None else onednn
        self.register_buffer("qweight", torch.ops.onednn.qlinear_prepack(qweight, None) if self._onednn else qweight)
        if self._onednn:
            self._ones = torch.ones(self.out_features)
            self._zeros = torch.zeros(self.out_features, dtype=torch.int32)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("inv_smooth", inv_smooth)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias)
        self._kernels = kernels

    def _products(self, q: torch.Tensor) -> torch.Tensor:
        """int8 [rows, in] -> the exact integer products [rows, out]: int32 from torch._int_mm,
        or float32 (exact: every sum is below 2^24) from oneDNN's prepacked kernel."""
        if self._onednn:
            return torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, self.qweight, self._ones, self._zeros, None, 1.0, 0,
                                                      torch.float32, "none", [], "")
        return torch._int_mm(q, self.qweight.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        ops = self._kernels
        if ops is not None and x.dtype in (torch.bfloat16, torch.float32):
            q, sx = ops.quant_rows(rows, self.inv_smooth)
            y = ops.dequant_rows(self._products(q), sx, self.weight_scale, self.bias, x.dtype is torch.bfloat16)
        else:
            q, sx = quant_rows_torch(rows, self.inv_smooth)
            y = dequant_rows_torch(self._products(q), sx, self.weight_scale, self.bias, x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def _int_mm_exact(wmax: int) -> bool:
    """Does ``torch._int_mm`` give the exact int32 products of full-range activations
    (+-127, the extremes included) and weights in [-wmax, wmax]?"""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (8, 256), generator=gen, dtype=torch.int8)
    a[0], a[1] = 127, -127
    b = torch.randint(-wmax, wmax + 1, (256, 32), generator=gen, dtype=torch.int8)
    b[:, 0], b[:, 1] = wmax, -wmax
    want = (a.double() @ b.double()).to(torch.int32)  # exact: every sum is far below 2^53
    return torch.equal(torch._int_mm(a, b), want)


def _onednn_exact(wmax: int) -> bool:
    """Does oneDNN's prepacked int8 product (``torch.ops.onednn.qlinear_pointwise``, unit
    scales, float32 out) give the exact products of full-range activations and weights in
    [-wmax, wmax], as ``_int_mm_exact`` asks of torch._int_mm?"""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (40, 576), generator=gen, dtype=torch.int8)
    a[0], a[1] = 127, -127
    w = torch.randint(-wmax, wmax + 1, (64, 576), generator=gen, dtype=torch.int8)
    w[0], w[1] = wmax, -wmax
    want = (a.double() @ w.double().t()).float()
    got = torch.ops.onednn.qlinear_pointwise(a, 1.0, 0, torch.ops.onednn.qlinear_prepack(w, None), torch.ones(64),
                                             torch.zeros(64, dtype=torch.int32), None, 1.0, 0, torch.float32, "none",
                                             [], "")
    return torch.equal(got, want)


@cache
def onednn_int8() -> bool:
    """Whether the int8 products go to oneDNN's prepacked kernel (PyTorch's own x86 int8
    linear, the one its inductor quantization lowers to) rather than torch._int_mm: on a CPU
    with AMX-INT8 that oneDNN may use, where this torch has the op and it is exact, unless
    ``FERRY_CPU_INT8_ONEDNN=0``. There it ran the model's shapes 1.5-3x faster than
    torch._int_mm at 512-2,048 rows and the gate/up product 1.8x at 64; without AMX
    (``ONEDNN_MAX_CPU_ISA=AVX2``) it was 2-3x slower at 64 rows, and under AVX512_CORE_VNNI
    one call took half a second (docs/benchmarks.md, "int8 weights")."""
    if not envs.CPU_INT8_ONEDNN.get():
        return False
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if not ops.cpu_flag("amx_int8") or (isa and isa not in ("ALL", "DEFAULT") and "AMX" not in isa):
        return False
    wmax = int8_weight_max()
    try:
        return wmax > 0 and _onednn_exact(wmax)
    except (RuntimeError, AttributeError) as exc:
        log.info("int8: oneDNN's prepacked int8 linear unavailable (%s); torch._int_mm instead", exc)
        return False


@cache
def int8_weight_max() -> int:
    """The largest |weight| this CPU's int8 products take without saturating: 127, or 63.

    oneDNN's int8 kernels on CPUs without VNNI (AVX2, or AVX-512 before Cascade Lake;
    also under ``ONEDNN_MAX_CPU_ISA=AVX2``) multiply unsigned-shifted activations by the
    weights with ``vpmaddubsw``, whose int16 pair sums saturate unless the weights fit in
    7 bits: full-range weights there gave products off by up to ~10^5 (docs/worker.md).
    A probe answers for the kernels this process actually runs, whatever the CPU or the
    environment. 0: not even 7-bit weights are exact (``int8_available`` says why).
    """
    for wmax in (127, 63):
        if _int_mm_exact(wmax):
            if wmax < 127:
                log.warning("int8: this CPU's int8 matmul saturates on 8-bit weights (no VNNI): "
                            "weights are quantized to 7 bits (+-%d)", wmax)
            return wmax
    return 0


def int8_available() -> str | None:
    """Why this torch cannot run int8 linears here (None: it can)."""
    try:
        a = torch.ones(2, 32, dtype=torch.int8)
        torch._int_mm(a, torch.ones(32, 8, dtype=torch.int8))
    except (RuntimeError, AttributeError) as exc:
        return f"torch._int_mm is unavailable on the CPU in this torch build ({exc})"
    if int8_weight_max() == 0:
        return "torch._int_mm returned wrong results on a probe, even with 7-bit weights"
    return None


def int8_kernels() -> ops.CpuKernels | None:
    """The CPU kernels' ``quant_rows``/``dequant_rows``, or None: PyTorch ops instead (no compiler)."""
    try:
        return ops.load()
    except Exception as exc:  # noqa: BLE001 - no compiler, a failed build: the PyTorch ops still work
        log.warning("int8 CPU kernels unavailable (%s); quantizing with PyTorch ops", exc)
        return None


def calibrate(model: nn.Module, body: nn.Module, vocab_size: int, tokens: int = CALIBRATION_TOKENS,
              seed: int = 0) -> dict[nn.Module, torch.Tensor]:
    """Each plain linear layer's largest |input| per input channel over one forward pass of
    ``tokens`` random token ids (a fixed seed: the same scales on every start).

    Random ids rather than a text: the outlier channels SmoothQuant tames are the model's
    own (they appear whatever the input), and on SmolLM2-135M random ids gave the lower
    perplexity of the two (docs/benchmarks.md, "int8 weights"). The pass runs on PyTorch's
    SDPA attention, outside ferry's paged step.
    """
    stats: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple[Any, ...], _out: Any) -> None:
        x = args[0].detach()
        seen = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        stats[module] = torch.maximum(stats[module], seen) if module in stats else seen

    hooks = [m.register_forward_hook(record) for m in body.modules() if type(m) is nn.Linear]
    config: Any = model.config
    saved = config._attn_implementation
    ids = torch.randint(0, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    try:
        config._attn_implementation = "sdpa"
        with torch.inference_mode():
            body(input_ids=ids.to(next(body.parameters()).device), use_cache=False)
    finally:
        config._attn_implementation = saved
        for h in hooks:
            h.remove()
    return stats


class Int8Factory:
    """Builds each ``Int8Linear`` with the calibrated input range of the layer(s) it replaces."""

    def __init__(self, kernels: ops.CpuKernels | None, stats: dict[nn.Module, torch.Tensor] | None = None) -> None:
        self.kernels, self.stats = kernels, stats or {}

    def __call__(self, linear: nn.Linear, like: nn.Module | None = None) -> Int8Linear:
        """``like``: the layer whose input ``linear`` sees (a fused group's first member)."""
        return Int8Linear(linear, self.kernels, self.stats.get(like if like is not None else linear))


def quantize_int8(model: nn.Module, make: Int8Factory | None = None, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every plain ``nn.Linear`` under ``model`` (in place, except those named in
    ``skip``) by an ``Int8Linear``; the number replaced."""
    reason = int8_available()
    if reason:
        raise RuntimeError(f"--quantization int8: {reason}")
    make = make or Int8Factory(None)
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in skip:
                setattr(parent, name, make(child))
                swapped += 1
    return swapped


def apply_int8(model: nn.Module, body: nn.Module, vocab_size: int, kernels: ops.CpuKernels | None) -> tuple[int, int]:
    """What ``--quantization int8`` does to a loaded model: calibrate, fuse q/k/v and
    gate/up into one int8 product each, quantize the other linears of ``body`` (the LM
    head stays as it is). Returns (groups fused, linear layers quantized in all)."""
    from .packed_linear import fuse_projections

    make = Int8Factory(kernels, calibrate(model, body, vocab_size))
    weight = next(body.parameters())
    fused = fuse_projections(body, weight.dtype, weight.device, make=make)
    return fused, fused + quantize_int8(body, make)


def packed_weight_bytes(model: nn.Module) -> int:
    """Bytes of the int8 weights, their scales and biases (buffers, outside ``parameters()``)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int8Linear):
            total += sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
    return total
