"""Quantized checkpoints of the tiny random models, in the ``compressed-tensors`` format, written
by the compressed-tensors library itself as llm-compressor's data-free schemes write them: each
targeted ``Linear`` gets the preset's quantization scheme, its weight scales from the weight's
own min/max (llm-compressor's default observer; no calibration data), and the model is
compressed and saved by ``ModelCompressor``, which adds the ``quantization_config``."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

SCHEMES = ("W8A8", "W8A16", "W4A16", "FP8", "FP8_DYNAMIC")


def build_compressed(plain: Path, folder: Path, scheme: str, ignore: tuple[str, ...] = ("lm_head",),
                     group_size: int | None = None) -> Path:
    """``plain`` (a model folder) quantized with compressed-tensors' preset ``scheme`` into ``folder``
    (``group_size``: another group size for a group-wise preset, where the layers' widths need one)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    preset = preset_name_to_scheme(scheme, ["Linear"])
    if group_size is not None and preset.weights is not None:
        preset.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": preset}, ignore=list(ignore))
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            qs = getattr(module, "quantization_scheme", None)
            if qs is None or qs.weights is None:
                continue
            weight: torch.Tensor = module.weight  # type: ignore[assignment]
            w, args = weight.detach(), qs.weights
            if args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif args.strategy == "group":
                grouped = w.reshape(w.shape[0], -1, args.group_size)
                lo, hi = grouped.amin(-1), grouped.amax(-1)
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, zero = calculate_qparams(lo, hi, args)
            weight_scale: torch.Tensor = module.weight_scale  # type: ignore[assignment]
            weight_scale.copy_(scale.reshape(weight_scale.shape))
            zero_point: torch.Tensor | None = getattr(module, "weight_zero_point", None)
            if zero_point is not None:
                zero_point.copy_(zero.reshape(zero_point.shape))
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    assert compressor is not None
    compressor.compress_model(model)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    for path in plain.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",):
            shutil.copy2(path, folder / path.name)
    return folder
