"""Quantized checkpoints: the ``compressed-tensors`` format (what vLLM's llm-compressor saves).

A checkpoint whose config carries a ``quantization_config`` is read here at load, scheme by
scheme, and either served or refused by name (``ModelRefused``), never half-understood:

- **W8A8 INT8** (weights int8, symmetric, one scale per output channel; activations int8,
  dynamic, symmetric, one scale per token): on the CPU the checkpoint's own integers and
  scales go into ferry's int8 layers (quantize.py's ``Int8Linear``, which computes exactly
  this scheme: oneDNN's or ``torch._int_mm``'s int8 products, per-token activation scales),
  q/k/v and gate/up fused by concatenating their rows and scales, not requantized.
- **Weight-only schemes** (W8A16 / W4A16 int, symmetric, per channel or per group; FP8 weights
  with per-channel or per-tensor scales, and FP8 W8A8 with dynamic per-token activations):
  transformers decompresses the weights at load (``CompressedTensorsConfig(dequantize=True)``)
  into the serving dtype, and ferry computes with them as with any checkpoint. The weights are
  the checkpoint's exactly (in float32; rounded once to bfloat16 in bfloat16); FP8 W8A8's
  activations are not rounded to FP8, so ferry's products are closer to the unquantized
  model's than the scheme's own (vLLM on a GPU rounds them). No memory or speed gain yet: the
  int4 and FP8 kernels are not built (docs/worker.md says what is missing).
- Refused, by name: static (calibrated) activation scales, asymmetric activations,
  activation group or tensor strategies other than per token, output activation
  quantization, a quantized KV cache scheme, sparsity (2:4), transforms (SpinQuant/QuIP
  rotations), NVFP4/MXFP4 and other bit widths; GPTQ, AWQ and every other ``quant_method``
  (the loader names it); ``--quantization int8`` on an already quantized checkpoint.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .attention import ModelRefused

log = logging.getLogger("ferry.worker.checkpoint_quant")


@dataclass(frozen=True)
class CheckpointScheme:
    """What a quantized checkpoint holds and how ferry runs it."""

    name: str  # e.g. "W8A8 int8 (compressed-tensors)"
    int8_layers: bool  # W8A8 int8: the checkpoint's integers go into ferry's int8 layers (on the CPU)
    ignore: tuple[str, ...]  # layers the checkpoint left unquantized (names or "re:" patterns)


def read_scheme(arch: str, config: Any) -> CheckpointScheme:
    """The scheme of a ``quantization_config`` (a dict or transformers' object), or ModelRefused."""
    qc = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ModelRefused(f"{arch}: ferry cannot serve this quantized checkpoint: quant_method {method!r} is not "
                           "supported (compressed-tensors checkpoints are: W8A8 int8, W8A16/W4A16 int, FP8)")

    def refuse(why: str) -> ModelRefused:
        return ModelRefused(f"{arch}: ferry cannot serve this compressed-tensors checkpoint exactly: {why}")

    if qc.get("kv_cache_scheme"):
        raise refuse("a quantized KV cache scheme (kv_cache_scheme)")
    if qc.get("sparsity_config"):
        raise refuse("sparse weights (sparsity_config)")
    if qc.get("transform_config"):
        raise refuse("weight transforms (transform_config: rotations)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise refuse("no config_groups")
    names = set()
    int8 = True
    for group_name, group in groups.items():
        weights, acts = group.get("weights"), group.get("input_activations")
        if group.get("output_activations"):
            raise refuse(f"{group_name}: quantized output activations")
        if not weights:
            raise refuse(f"{group_name}: activations quantized without weights")
        wname = _weight_scheme(weights, refuse, group_name)
        if acts is None:
            names.add(f"{wname} weights only")
            int8 = False
            continue
        if not acts.get("dynamic"):
            raise refuse(f"{group_name}: static (calibrated) input activation scales")
        if not acts.get("symmetric", True):
            raise refuse(f"{group_name}: asymmetric input activations")
        if acts.get("strategy") != "token":
            raise refuse(f"{group_name}: input activations quantized per {acts.get('strategy')}, not per token")
        atype, abits = acts.get("type"), acts.get("num_bits")
        if (atype, abits) == ("int", 8) and wname == "int8 per channel":
            names.add("W8A8 int8")
        elif (atype, abits) == ("float", 8) and wname.startswith("fp8"):
            names.add(f"W8A8 {wname}, dynamic per-token fp8 activations (run unrounded)")
            int8 = False
        else:
            raise refuse(f"{group_name}: {atype}{abits} activations with {wname} weights")
    ignore = tuple(str(x) for x in (qc.get("ignore") or ()))
    return CheckpointScheme(name=" + ".join(sorted(names)) + " (compressed-tensors)", int8_layers=int8,
                            ignore=ignore)


def _weight_scheme(weights: dict[str, Any], refuse: Any, group_name: str) -> str:
    wtype, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if weights.get("dynamic"):
        raise refuse(f"{group_name}: dynamic weight scales")
    if weights.get("actorder") not in (None, "static", False):
        raise refuse(f"{group_name}: activation-ordered groups (actorder={weights.get('actorder')})")
    if wtype == "int" and bits in (4, 8):
        if not weights.get("symmetric", True):
            raise refuse(f"{group_name}: asymmetric int{bits} weights (zero points)")
        if strategy == "channel":
            return f"int{bits} per channel"
        if strategy == "group":
            return f"int{bits} per group of {weights.get('group_size')}"
        raise refuse(f"{group_name}: int{bits} weights per {strategy}")
    if wtype == "float" and bits == 8:
        if strategy not in ("channel", "tensor"):
            raise refuse(f"{group_name}: fp8 weights per {strategy}")
        return f"fp8 per {strategy}"
    raise refuse(f"{group_name}: {wtype}{bits} weights")


def load_kwargs(scheme: CheckpointScheme) -> dict[str, Any]:
    """What ``from_pretrained`` needs: the weights decompressed into the serving dtype (the int8
    layers then take the checkpoint's integers from the files, ``attach_int8``)."""
    from transformers import CompressedTensorsConfig

    try:
        config = CompressedTensorsConfig(dequantize=True)
    except TypeError:  # transformers before `dequantize`: the older name
        config = CompressedTensorsConfig(run_compressed=False)
    return {"quantization_config": config}


def attach_int8(model: nn.Module, folder: Path) -> int:
    """Give each linear layer the checkpoint quantized to W8A8 int8 its stored integers and
    scales (``checkpoint_int8``: int8 [out, in], float32 [out]); the number given."""
    stored = _int8_tensors(folder)
    given = 0
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        entry = stored.get(name)
        if entry is None:
            continue
        q, scale = entry
        if tuple(q.shape) != tuple(module.weight.shape):
            raise ModelRefused(f"{name}: stored int8 weight {tuple(q.shape)} does not match the layer "
                               f"{tuple(module.weight.shape)}")
        module.checkpoint_int8 = (q, scale)  # type: ignore[assignment]
        given += 1
    return given


def _int8_tensors(folder: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{layer name: (int8 weight, float32 scale per row)} for every int8 weight in the checkpoint."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scales: dict[str, torch.Tensor] = {}
    ints: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open's handle is not a mapping
                if key.endswith(".weight_scale"):
                    scales[key.removesuffix(".weight_scale")] = f.get_tensor(key)
                elif key.endswith(".weight"):
                    sl = f.get_slice(key)
                    if sl.get_dtype() in ("I8", "int8"):
                        ints[key.removesuffix(".weight")] = f.get_tensor(key)
    for name, q in ints.items():
        scale = scales.get(name)
        if scale is None or scale.numel() != q.shape[0]:
            raise ModelRefused(f"{name}: an int8 weight without one scale per output channel")
        out[name] = (q, scale.float().reshape(-1).contiguous())
    return out


def checkpoint_int8_runs() -> bool:
    """Whether this CPU's int8 products take a checkpoint's full-range int8 weights exactly; where
    not (no VNNI: 7-bit weights only, quantize.py), its layers stay dequantized, logged."""
    from .quantize import int8_available, int8_weight_max

    why = int8_available()
    if why is None and int8_weight_max() == 127:
        return True
    log.warning("W8A8 int8 checkpoint served with dequantized weights: %s",
                why or "this CPU's int8 products saturate on full-range int8 weights (no VNNI)")
    return False


def apply_checkpoint_int8(body: nn.Module, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """The W8A8 checkpoint's layers (those ``attach_int8`` marked) as ferry's int8 layers, q/k/v
    and gate/up fused first; any other linear layer packed as in an unquantized model. Returns
    (groups fused, int8 layers in all)."""
    from .packed_linear import fuse_projections, pack_linears
    from .quantize import Int8Linear, int8_kernels

    kernels = int8_kernels()

    def make(linear: nn.Linear, like: nn.Module | None = None) -> nn.Module:
        stored = getattr(linear, "checkpoint_int8", None)
        if stored is None:
            raise RuntimeError("a layer of the group is not int8 in the checkpoint")
        return Int8Linear(linear, kernels, stored=stored)

    fused = fuse_projections(body, dtype, device, make=make)
    swapped = 0
    for parent in list(body.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and getattr(child, "checkpoint_int8", None) is not None:
                setattr(parent, name, make(child))
                swapped += 1
    pack_linears(body, dtype, device)
    return fused, fused + swapped
