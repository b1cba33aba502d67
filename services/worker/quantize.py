"""``--quantization int8``: the linear layers' weights as int8, through PyTorch's own
dynamic quantization (``torch.ao.quantization.quantize_dynamic``; fbgemm/x86 kernels).

Weights are quantized once at load, per output channel (one scale per row, which keeps
small-magnitude rows precise); activations are quantized per step on the fly and the
products accumulate in int32, so the model still computes in float32 between linear
layers (norms, attention, the KV cache). The LM head is quantized too: at decode batch
sizes it is bound by reading its 49,152 x 576 weight, which int8 makes 4x smaller.
Its quality cost is measured by ``services.engine.bench_quality`` (docs/worker.md).
CPU only, opt-in.
"""

from __future__ import annotations

import logging
import warnings

import torch

log = logging.getLogger("ferry.worker.quantize")


def _engine() -> str:
    engines = torch.backends.quantized.supported_engines
    for name in ("x86", "fbgemm"):
        if name in engines:
            return name
    raise RuntimeError(f"no int8 CPU engine in this torch build (supported: {engines})")


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a dynamic int8 linear."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    torch.backends.quantized.engine = _engine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    num = sum(1 for m in model.modules() if _is_quantized(m))
    log.info("int8: %d linear layers quantized (engine %s)", num, torch.backends.quantized.engine)
    return model


def _is_quantized(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "Linear" and type(module).__module__.startswith("torch.ao.nn.quantized.dynamic")


def packed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the int8 weights (and float biases) that quantized linears hold outside ``parameters()``."""
    total = 0
    for module in model.modules():
        if _is_quantized(module):
            weight, bias = module._packed_params._weight_bias()  # type: ignore[operator,union-attr]
            total += weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())
    return total
