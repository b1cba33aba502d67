"""The attention backends' interface (``PagedBatch``, ``AttentionBackend``) and their registry.

Backends import this module, never the package, so the package's ``__init__`` can import
the built-in backends (which register themselves here) without an import circle.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class PagedBatch:
    """One step's attention work, built once per step by the runner, read by every layer."""

    num_reqs: int
    num_decodes: int  # the first num_decodes requests have query length 1
    num_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32 on the device
    seq_lens: torch.Tensor  # [num_reqs] int32 on the device: context length after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32 on the device, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64 on the device: flat KV slot of each new token
    max_query_len: int
    max_seq_len: int
    block_size: int
    max_model_len: int  # no sequence is longer (sliding windows at least this wide change nothing)
    # Host copies (plain ints) for backends that plan on the CPU, so they never sync the device.
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]


class AttentionBackend(ABC):
    """A paged attention implementation for one kind of device."""

    name: ClassVar[str]

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
