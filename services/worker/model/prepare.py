"""The CPU weight rewriting a runner does once, after loading and before the KV cache is used.

On the CPU, in bfloat16 and float32, the model transformers loaded is rewritten in place:
q/k/v and gate/up fused into one product each, every linear layer on oneDNN-packed weights
(packed_linear.py) or ``--quantization int8`` layers (quantize.py), a tied LM head packed as
its own copy with the embedding reading its rows from the head's tiles, oneDNN's copies
dropped where ferry's kernels take every product, RMSNorm, RoPE and SiLU-and-mul as fused ops
(fused_ops.py), and the step's forward without transformers' per-layer Python
(lean_forward.py). Every swap is checked against the code it replaces and skipped when
the check fails. Elsewhere (a GPU) each step finds nothing to do and the model stays as loaded.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from .batch_invariant import make_linears_batch_invariant
from .checkpoint_quant import apply_checkpoint_int8, checkpoint_int8_runs
from .fused_ops import fuse_elementwise
from .fused_ops import kernels as fused_kernels
from .lean_forward import LeanDecoder
from .moe import pack_experts
from .packed_linear import PackedLinear, fuse_projections, pack_linears, share_tied_embedding
from .quantize import apply_int8, int8_kernels

log = logging.getLogger("ferry.worker.runner")


@dataclass
class PreparedWeights:
    lm_head: nn.Module  # the model's output layer after the rewrite (a PackedLinear where packed)
    lean: LeanDecoder | None  # the step's forward without transformers' per-layer Python (None: the model's)


def prepare_cpu_weights(model: nn.Module, dtype: torch.dtype, device: torch.device, *, quantization: str | None,
                        vocab_size: int, max_num_seqs: int, tensor_parallel: bool,
                        batch_invariant: bool = False) -> PreparedWeights:
    """Rewrite ``model``'s weights and layers in place for the CPU's kernels (see the module doc).

    ``max_num_seqs`` bounds the rows the LM head ever sees (oneDNN's copy of it is dropped
    where ferry's kernels take that many); with ``tensor_parallel`` the LM head (wrapped per
    rank) and the forward stay the model's own. ``batch_invariant`` (``--deterministic``): every
    linear layer then computes a row alike at any row count (batch_invariant.py), before the
    lean forward reads their kernels' bounds.
    """
    body = model.get_decoder()  # type: ignore[operator]
    lm_head = model.get_output_embeddings()  # type: ignore[operator]
    # CPU, bfloat16 and float32: the decoder's linear layers and the LM head multiply against
    # oneDNN-packed weights (packed_linear.py). A head tied to the embedding gets its own
    # packed copy (SmolLM2: 57 MB more) for 1.3x at a decode batch of 64 and 1.8x for one
    # decode (docs/benchmarks.md, "Kernels: linear products"); where that copy is the
    # tiled kernel's, the embedding reads its rows from it and drops the plain weight.
    if quantization == "int8":
        # W8A8 (quantize.py): q/k/v and gate/up fused first, so each group is one int8 product
        ops = int8_kernels()
        fused, quantized = apply_int8(model, body, vocab_size, ops)
        log.info("int8: %d linear layers quantized (W8A8, per-token activations, SmoothQuant; %s)",
                 quantized, "CPU kernels" if ops is not None else "PyTorch ops")
        packed = 0
    elif quantization == "checkpoint-int8" and checkpoint_int8_runs():
        # a W8A8 int8 checkpoint: its own integers and scales (checkpoint_quant.py)
        fused, quantized = apply_checkpoint_int8(body, dtype, device)
        log.info("W8A8 int8 checkpoint: %d linear layers on ferry's int8 path (its integers, per-token activations)",
                 quantized)
        packed = 0
    else:
        fused = fuse_projections(body, dtype, device)
        packed = pack_linears(body, dtype, device)
        experts = pack_experts(body, dtype, device)
        if experts:
            log.info("%d mixture-of-experts layers: each expert's products on packed weights", experts)
    if fused:
        log.info("%d q/k/v and gate/up groups fused", fused)
    if not tensor_parallel:
        lm_head, head_packed = _pack_head(model, body, lm_head, dtype, device, max_num_seqs)
        packed += head_packed
    if packed:
        log.info("%d linear layers on oneDNN-packed weights", packed)
    tiled = [m for m in model.modules() if isinstance(m, PackedLinear) and m.tiles is not None]
    if tiled:
        splits = Counter(m.split() for m in tiled)
        log.info("%d of them on ferry's bfloat16 kernels (%d MB of tiles): %s", len(tiled),
                 sum(m.tiles.nbytes for m in tiled if m.tiles is not None) // 10**6,
                 "; ".join(f"{n} {split}" for split, n in splits.items()))
    if batch_invariant:
        ways, replaced = make_linears_batch_invariant(model, device)
        lm_head = replaced.get(id(lm_head), lm_head)
        log.info("deterministic: linear layers batch-invariant: %s",
                 ", ".join(f"{n} on {way}" for way, n in ways.items()) or "none")
    fused_ops = fuse_elementwise(body, dtype, device)
    if any(fused_ops.values()):
        log.info("fused CPU ops: %s", ", ".join(f"{n} {k}" for k, n in fused_ops.items()))
    # CPU: the step's forward without transformers' per-layer Python (lean_forward.py).
    lean: LeanDecoder | None = None
    if device.type == "cpu" and not tensor_parallel:
        lean = LeanDecoder.build(body, fused_kernels() if any(fused_ops.values()) else None,
                                 batch_invariant=batch_invariant)
        log.info("lean forward: %s", lean.mode if lean else "off (this model's layers)")
    return PreparedWeights(lm_head=lm_head, lean=lean)


def _pack_head(model: nn.Module, body: nn.Module, lm_head: nn.Module, dtype: torch.dtype, device: torch.device,
               max_num_seqs: int) -> tuple[nn.Module, int]:
    """Pack the LM head (its own copy where tied to the embedding, which then reads its rows
    from the head's tiles); the head after it and the layers packed."""
    # (a model already packed by an earlier runner in this process has no .weight here)
    tied = getattr(lm_head, "weight", None) is body.get_input_embeddings().weight  # type: ignore[operator]
    head_packed = pack_linears(model, dtype, device)
    if not head_packed:
        return lm_head, 0
    lm_head = model.get_output_embeddings()  # type: ignore[operator]
    if tied and isinstance(lm_head, PackedLinear):
        own = lm_head.packed if lm_head.packed is not None else lm_head.tiles
        log.info("tied LM head packed as its own copy (%d bytes)", 0 if own is None else own.nbytes)
        # ... and the embedding reads its rows from the head's tiles: one copy fewer
        shared = share_tied_embedding(body, lm_head)
        if shared:
            log.info("tied embedding read from the LM head's tiles (%d bytes of plain weight dropped)", shared)
    # The head never sees more rows than there are requests in a step: where the tiled
    # kernel and the AMX products take that many, oneDNN's copy is never read
    if isinstance(lm_head, PackedLinear) and lm_head.packed is not None and lm_head.covers(max_num_seqs):
        dropped = lm_head.packed.nbytes
        lm_head.drop_packed(max_num_seqs)
        log.info("LM head: oneDNN's copy dropped (%d bytes; its products of up to %d rows on the "
                 "tiled kernels)", dropped, max_num_seqs)
    return lm_head, head_packed
