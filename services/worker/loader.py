"""Loading a model for the worker: resolve ``--model``, convert a GGUF once, pick the dtype.

A GGUF loaded through transformers is dequantized tensor by tensor (~20 s for
SmolLM2-135M), so it is converted once into ``<cache>/models/<hash>/model/`` as a
plain safetensors folder (written atomically, see ``shared.models``) and every
later start loads that folder in about two seconds.

The trap: ``save_pretrained`` refuses a model loaded from GGUF ("quantized with
gguf and is not serializable") although every layer is a plain ``nn.Linear``.
We build a fresh model from the config without its ``quantization_config`` and
copy the dequantized weights in; that one saves normally.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared import capacity
from shared.models import ModelSource, converted_root, resolve_model, tokenizer_dir, write_atomically

from .model.attention import ATTN_IMPLEMENTATION, ModelRefused, register_paged_attention
from .model.checkpoint_quant import CheckpointScheme, attach_int8, load_kwargs, read_scheme

log = logging.getLogger("ferry.worker.loader")

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (causal LM)
    hf_config: Any  # its PretrainedConfig
    config_dict: dict[str, Any]  # plain dict, for shared.capacity
    model_dir: Path  # the folder the weights came from
    dtype: torch.dtype
    load_s: float
    checkpoint_scheme: CheckpointScheme | None = None  # a quantized checkpoint's (model/checkpoint_quant.py)


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``auto`` is bfloat16 on a GPU and float32 on a CPU (docs/worker.md says why).

    The rule lives in ``shared.capacity.resolve_dtype`` so ``ferry plan`` sizes the
    same KV cache the worker allocates.
    """
    name = capacity.resolve_dtype(dtype, device)
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported for weights: expected auto, bfloat16, float32 or float16")
    return DTYPES[name]


def model_dir(source: ModelSource, cache_dir: str = "") -> Path:
    """A safetensors folder for ``source``: the folder itself, or the GGUF's cached conversion."""
    if source.kind == "hf_dir":
        return source.path
    return write_atomically(converted_root(source, cache_dir) / "model", lambda tmp: _convert_gguf(source, cache_dir, tmp))


def _convert_gguf(source: ModelSource, cache_dir: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    t0 = time.monotonic()
    log.info("converting %s to safetensors (once; cached under %s)", source.path, out.parent)
    folder, filename = str(source.path.parent), source.path.name
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied lm_head weights may be absent from a GGUF state dict; anything else is a bug.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    plain.save_pretrained(out, safe_serialization=True)
    tok = tokenizer_dir(source, cache_dir)
    for path in tok.iterdir():
        if path.is_file() and path.name != "config.json":
            shutil.copy2(path, out / path.name)
    log.info("converted in %.1fs", time.monotonic() - t0)


QUANTIZATIONS = ("none", "int8")


def load_model(
    name: str, dtype: str = "auto", device: str = "cpu", cache_dir: str = "", quantization: str = "none"
) -> LoadedModel:
    """Load ``name`` with ferry's paged attention as its attention implementation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.monotonic()
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported: expected one of {', '.join(QUANTIZATIONS)}")
    source = resolve_model(name)
    folder = model_dir(source, cache_dir)
    torch_dtype = resolve_dtype(dtype, device)
    if quantization == "int8" and not device.startswith("cpu"):
        raise ValueError("--quantization int8 runs on the CPU only (PyTorch's int8 matmul, torch._int_mm)")
    register_paged_attention()
    hf_config = AutoConfig.from_pretrained(folder)
    scheme = None
    extra: dict[str, Any] = {}
    if getattr(hf_config, "quantization_config", None) is not None:
        arch = ",".join(getattr(hf_config, "architectures", None) or [type(hf_config).__name__])
        scheme = read_scheme(arch, hf_config.quantization_config)
        if quantization != "none":
            raise ValueError(f"{name}: --quantization {quantization} on a checkpoint already quantized "
                             f"({scheme.name}): leave it out")
        extra = load_kwargs(scheme)
        log.info("quantized checkpoint: %s", scheme.name)
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtype, attn_implementation=ATTN_IMPLEMENTATION, device_map=None, **extra
        )
    except (KeyError, ValueError) as exc:
        if ATTN_IMPLEMENTATION not in str(exc):
            raise
        # the model code picks its attention from a table of its own (Falcon's classes), not
        # through transformers' attention interface: ferry's paged attention cannot be plugged in
        arch = ",".join(getattr(hf_config, "architectures", None) or [type(hf_config).__name__])
        raise ModelRefused(f"{arch}: ferry cannot serve this model: its attention does not go through "
                           f"transformers' attention interface ({type(exc).__name__}: {exc})") from exc
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    # --quantization int8 is applied by the runner, after it fuses q/k/v and gate/up (quantize.py);
    # so are a W8A8 checkpoint's int8 layers, from the integers given to its layers here
    if scheme is not None and scheme.int8_layers and device.startswith("cpu"):
        log.info("W8A8 int8: %d layers take the checkpoint's integers", attach_int8(model, folder))
    config_dict = hf_config.to_dict()
    return LoadedModel(model, model.config, config_dict, folder, torch_dtype, time.monotonic() - t0, scheme)
