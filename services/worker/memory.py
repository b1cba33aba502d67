"""The worker's resident memory outside the KV cache: what start-up leaves behind, and what it never needs.

Two things cost a CPU worker memory it does not use (docs/worker.md, "Where the
worker's memory goes"):

- loading frees a lot (transformers reads the float32 safetensors and converts them
  to bfloat16; packed_linear.py reorders the weights for oneDNN and drops the plain
  ones; q/k/v and gate/up are concatenated), and glibc keeps those freed chunks in
  its heap and per-thread arenas instead of returning them to the kernel: ~200 MiB
  of RSS at ready for SmolLM2-135M. ``release_freed_memory`` (``malloc_trim(0)``,
  shared/heap.py) hands back every whole free page at the end of start-up, and once
  more when the grammar tokenizer (loaded in a side thread from start-up, often done
  only after ready) has loaded: 20-30 MiB more. It only ever releases *free* chunks:
  the KV cache (written in full by ``KVCache.allocate``) and the weights stay resident.
- transformers' ``modeling_utils`` imports ``torch._dynamo`` (a decorator in its
  DeepGEMM integration), which imports Triton whenever it is installed (the dev
  extra, or a CUDA build of torch): ~50 MiB resident, 48 of them libtriton.so. Nothing
  in a CPU worker runs Triton, so ``keep_out_unused_modules`` marks it absent
  (``sys.modules["triton"] = None``: imports raise ``ImportError``, ``find_spec``
  answers None, which torch and transformers read as "no Triton") before the model
  code is imported.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

from shared.heap import keep_freed_memory, release_and_log, release_freed_memory, rss_bytes

if TYPE_CHECKING:  # no torch at import: service.py imports this before the slow torch import
    import torch

log = logging.getLogger("ferry.worker.memory")

__all__ = ["keep_freed_memory", "keep_out_unused_modules", "log_ready_memory", "release_and_log", "release_freed_memory",
           "host_tensor_bytes", "module_tensors"]


# Imported by a CPU worker's dependencies, run by nothing in it (see the module docstring).
CPU_UNUSED_MODULES = ("triton",)


def keep_out_unused_modules(device: str, modules: MutableMapping[str, Any] | None = None) -> list[str]:
    """On a CPU worker, mark the modules it never runs as absent; the names marked.

    Only names not imported yet are marked (an imported module stays usable), and
    nothing on a GPU worker: the triton attention backend needs Triton there.
    """
    if not device.startswith("cpu"):
        return []
    mods: MutableMapping[str, Any] = sys.modules if modules is None else modules
    marked = []
    for name in CPU_UNUSED_MODULES:
        if name not in mods:
            mods[name] = None
            marked.append(name)
    return marked


def host_tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct host (CPU) storages behind ``tensors``: views and shared
    weights count once, device tensors not at all (they are not in the RSS).

    oneDNN-packed weights (``PackedLinear.packed``) are opaque tensors without a
    storage to share: each counts its own ``nbytes``.
    """
    storages: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t.device.type != "cpu":
            continue
        try:
            s = t.untyped_storage()
            key, size = (str(s.device), s.data_ptr()), s.nbytes()
        except (NotImplementedError, RuntimeError):  # OpaqueTensorImpl: no storage
            key, size = ("opaque", id(t)), t.nbytes
        storages[key] = max(size, storages.get(key, 0))
    return sum(storages.values())


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers, persistent or not."""
    return [*module.parameters(), *(b for _, b in module.named_buffers(remove_duplicate=False))]


def log_ready_memory(model: torch.nn.Module, kv_caches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                     released: int | None) -> dict[str, int]:
    """One line at ready: RSS split into the KV cache and the weights (as held now, in host
    memory) and the rest (the Python and torch runtime, libraries, allocator slack). Never raises."""
    try:
        return _log_ready_memory(model, kv_caches, released)
    except Exception as exc:  # noqa: BLE001 - a report, not a reason to stop a loaded worker
        log.warning("memory at ready: not measured (%r)", exc)
        return {}


def _log_ready_memory(model: torch.nn.Module, kv_caches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                      released: int | None) -> dict[str, int]:
    rss = rss_bytes()
    kv = host_tensor_bytes([t for pair in kv_caches for t in pair])
    weights = host_tensor_bytes(module_tensors(model))
    parts = {"rss": rss, "kv_cache": kv, "weights": weights, "rest": rss - kv - weights}
    log.info("memory at ready (MiB): RSS %d = KV cache %d + weights %d (as packed) + the rest %d; %s",
             rss >> 20, kv >> 20, weights >> 20, parts["rest"] >> 20,
             "malloc_trim: not glibc" if released is None else f"malloc_trim released {released >> 20}")
    return parts
