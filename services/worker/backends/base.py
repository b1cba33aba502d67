"""The attention backends' interface (``PagedBatch``, ``AttentionBackend``) and their registry.

Backends import this module, never the package, so the package's ``__init__`` can import
the built-in backends (which register themselves here) without an import circle.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .paged import PagedBatch, as_decodes, raw_bytes, write_kv
from .variant import AttentionVariant, invariant_attention, variant_attention

__all__ = ["AttentionBackend", "BackendFactory", "PagedBatch", "as_decodes", "available_backends", "raw_bytes",
           "register_backend", "select_backend", "write_kv"]


class AttentionBackend(ABC):
    """A paged attention implementation for one kind of device."""

    name: ClassVar[str]
    # Set by the runner under --deterministic: ``prepare`` sees ``as_decodes(batch)``, and the
    # backend's decode path must reduce each token's keys in an order that depends on that
    # token's context alone (backends that cannot must refuse in ``make_batch_invariant``).
    batch_invariant: bool = False

    def make_batch_invariant(self) -> None:
        """Compute every token through the decode path (``as_decodes``), batch-invariantly."""
        self.batch_invariant = True

    def write_new_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
        """Store the step's new keys/values at their slots (backends with a kernel for it override)."""
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def forward_variant(
        self,
        layer_idx: int,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedBatch,  # the step's (not as_decodes'd)
        scale: float,
        variant: AttentionVariant,
    ) -> torch.Tensor:
        """``forward`` for a layer with an attention variant (soft-cap, sinks, a window that bites):
        this backend's own KV write, then ``variant_attention`` over the cache (backends/variant.py),
        or its block-at-a-time form under ``--deterministic``. Every backend honours the variants
        this way; their fast kernels stay for plain layers."""
        self.write_new_kv(key, value, k_cache, v_cache, batch.slot_mapping)
        if not self.batch_invariant:
            return variant_attention(query, k_cache, v_cache, batch, scale, variant)
        cached = self._as_decodes
        if cached is None or cached[0] is not batch:
            decodes = as_decodes(batch)
            width = -(-max(decodes.seq_lens_cpu, default=1) // decodes.block_size)
            cached = self._as_decodes = (batch, decodes.block_table[:, :width].long(), decodes.seq_lens.long())
        return invariant_attention(query, k_cache, v_cache, cached[1], cached[2], scale, variant)

    _as_decodes: tuple[PagedBatch, torch.Tensor, torch.Tensor] | None = None  # forward_variant's, per step

    @property
    def layer_windows(self) -> dict[int, int]:
        """Each layer seen attending through a sliding window, and the window (the probe's forward
        fills it; the runner checks a hybrid KV cache's layout against it)."""
        windows: dict[int, int] | None = self.__dict__.get("_layer_windows")
        if windows is None:
            windows = self.__dict__["_layer_windows"] = {}
        return windows

    @property
    def variant_layers(self) -> set[int]:
        """Layers seen computing an attention variant that bites within max_model_len (the load-time
        probe's forward fills it): their steps depend on host-side lengths, so no decode graphs."""
        layers: set[int] | None = self.__dict__.get("_variant_layers")
        if layers is None:
            layers = self.__dict__["_variant_layers"] = set()
        return layers

    @abstractmethod
    def prepare(self, batch: PagedBatch) -> Any:
        """Per-step metadata for ``forward``, built once per step and shared by all layers."""

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (the new tokens' keys)
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: Any,  # what prepare returned for this step
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write key/value into their slots of the cache, then attend causally over each
        request's whole context (cached prefix + the new tokens)."""


BackendFactory = Callable[[torch.device], AttentionBackend]
_REGISTRY: dict[str, tuple[BackendFactory, tuple[str, ...]]] = {}
_AUTO_ORDER: dict[str, list[str]] = {}


def register_backend(name: str, factory: BackendFactory, device_types: tuple[str, ...], auto_rank: int | None = None) -> None:
    """Make ``name`` selectable on ``device_types``; with ``auto_rank``, ``auto`` may pick it
    (lower rank wins)."""
    _REGISTRY[name] = (factory, device_types)
    if auto_rank is not None:
        for dev in device_types:
            order = _AUTO_ORDER.setdefault(dev, [])
            entry = f"{auto_rank:04d}:{name}"
            if entry not in order:  # a module registering again (a lazy stub, then the real one)
                order.append(entry)
                order.sort()


def available_backends(device_type: str | None = None) -> list[str]:
    return sorted(n for n, (_, devs) in _REGISTRY.items() if device_type is None or device_type in devs)


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend ``name`` (or ``auto``: the best registered one for ``device.type``)."""
    if name == "auto":
        order = [entry.split(":", 1)[1] for entry in _AUTO_ORDER.get(device.type, [])]
        if not order:
            raise ValueError(f"no attention backend registered for device {device.type!r}")
        for candidate in order[:-1]:
            try:  # a backend may be unusable here (no compiler for its kernel): take the next
                return _REGISTRY[candidate][0](device)
            except Exception as exc:  # noqa: BLE001 - any failure to build means "not available here"
                logging.getLogger("ferry.worker.backends").warning(
                    "attention backend %s unavailable on %s (%s); trying the next", candidate, device.type, exc)
        name = order[-1]
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(available_backends())}")
    factory, devices = _REGISTRY[name]
    if device.type not in devices:
        raise ValueError(f"attention backend {name!r} runs on {', '.join(devices)}, not on {device.type}")
    return factory(device)
