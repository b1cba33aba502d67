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


def as_decodes(batch: PagedBatch) -> PagedBatch:
    """``batch`` with every query token as a decode of its own: token t of a chunk that starts
    at position p attends as a one-token request of context p + t + 1 over its request's block
    table (its own key is in the cache by then: every backend writes a step's keys and values
    before it attends).

    Batch-invariant attention (``--deterministic``, docs/api.md) computes every token this way,
    so a token's reduction over its keys is the decode kernel's, in the same order, whether it
    is computed in a prompt chunk of any size, after a prefix-cache hit, after a preemption or
    as a decode beside any other requests. A step of decodes only is returned as it is.
    """
    if batch.num_decodes == batch.num_reqs:
        return batch
    qsl = torch.tensor(batch.query_start_loc_cpu, dtype=torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    rows = torch.repeat_interleave(torch.arange(batch.num_reqs), q_lens)
    first = torch.tensor(batch.seq_lens_cpu, dtype=torch.int64) - q_lens  # each chunk's first position
    lens = first[rows] + torch.arange(len(rows)) - qsl[:-1][rows] + 1
    n = int(rows.numel())
    device = batch.block_table.device
    return PagedBatch(
        num_reqs=n, num_decodes=n, num_tokens=n,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32).to(device, non_blocking=True),
        seq_lens=lens.to(torch.int32).to(device, non_blocking=True),
        block_table=batch.block_table.index_select(0, rows.to(device, non_blocking=True)),
        slot_mapping=batch.slot_mapping, max_query_len=1, max_seq_len=batch.max_seq_len,
        block_size=batch.block_size, max_model_len=batch.max_model_len,
        query_start_loc_cpu=tuple(range(n + 1)), seq_lens_cpu=tuple(lens.tolist()),
    )


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
