"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket.

A small model's decode step on a GPU is bound by kernel launches, not by the
GPU: ~10 launches per layer from Python, each a few microseconds of host time,
against a few microseconds of GPU work. Capturing the whole forward (embedding,
layers, attention kernels, LM head) once per batch size and replaying it turns
hundreds of launches into one.

A graph replays fixed addresses and fixed shapes, so:

- inputs live in *static buffers* sized for the largest bucket (token ids,
  positions, slot mapping, block tables, context lengths); each step copies the
  real rows in (device-to-device, from the one staged host copy) and pads the
  rest of its bucket: padded rows write no KV (slot -1), attend to one key
  (context length 1) and their outputs are never read;
- batch sizes are bucketed: 1, 2, 4, 8, then every 16 up to ``max_num_seqs``
  (and ``max_num_seqs`` itself), so a step pads by at most 15 rows;
- the attention metadata is prepared at capture time for the longest context
  (``max_model_len``): the kernels read each row's real length from the buffer;
- only steps whose every request has one query token replay a graph; a step
  with any prefill chunk, or more requests than the largest bucket, runs eager.

Only backends that declare ``supports_cuda_graphs`` (their ``prepare`` depends
on host-side sizes only and their kernels read everything else from device
buffers) are captured; ``--enforce-eager`` turns graphs off altogether.
The bucket logic and buffer filling are plain tensor code, tested on the CPU
with an eager stand-in for the graph (tests/unit/worker/test_triton_cuda_graphs.py).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..backends import PagedBatch

log = logging.getLogger("ferry.worker.cuda_graphs")

# forward(input_ids [1, B], positions [1, B], batch) -> logits [B, vocab]: the runner's model body + LM head.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, PagedBatch], torch.Tensor]


class Replayable(Protocol):
    def replay(self) -> None: ...


# capture(fn) -> (graph, output): runs fn under capture and returns the graph and fn's output tensor.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Replayable, torch.Tensor]]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, 16, 32, 48, ... up to and including ``max_num_seqs``."""
    if max_num_seqs < 1:
        return []
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def pick_bucket(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding ``num_reqs`` rows (None: too many, run eager)."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) and num_reqs > 0 else None


def is_decode_only(batch: PagedBatch) -> bool:
    return batch.num_reqs > 0 and batch.num_decodes == batch.num_reqs and batch.num_tokens == batch.num_reqs


@dataclass
class StaticDecodeInputs:
    """The buffers every captured graph reads; rows [0, max_batch) of each."""

    input_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slot_mapping: torch.Tensor  # [max_batch] int64, -1 on padded rows
    seq_lens: torch.Tensor  # [max_batch] int32, 1 on padded rows
    block_table: torch.Tensor  # [max_batch, max_blocks] int32
    query_start_loc: torch.Tensor  # [max_batch + 1] int32: 0, 1, 2, ... (one token per request)

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> StaticDecodeInputs:
        return cls(
            input_ids=torch.zeros(max_batch, dtype=torch.int64, device=device),
            positions=torch.zeros(max_batch, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=device),
            seq_lens=torch.ones(max_batch, dtype=torch.int32, device=device),
            block_table=torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
        )

    def fill(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> None:
        """Copy one decode-only step's rows in and pad the bucket's remaining rows."""
        n = batch.num_reqs
        cols = batch.block_table.shape[1]
        if cols > self.block_table.shape[1]:
            raise ValueError(f"block table of {cols} blocks exceeds the captured {self.block_table.shape[1]}")
        self.input_ids[:n].copy_(input_ids.reshape(-1), non_blocking=True)
        self.positions[:n].copy_(positions.reshape(-1), non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        # Columns past ``cols`` keep stale (valid) block ids: kernels never read past a row's length.
        self.block_table[:n, :cols].copy_(batch.block_table, non_blocking=True)
        if bucket > n:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].fill_(1)

    def batch_for(self, bucket: int, block_size: int, max_model_len: int) -> PagedBatch:
        """The PagedBatch a bucket's graph is captured with: views of the static buffers,
        sized for the longest possible context (the kernels read real lengths at replay)."""
        return PagedBatch(
            num_reqs=bucket, num_decodes=bucket, num_tokens=bucket,
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_table=self.block_table[:bucket],
            slot_mapping=self.slot_mapping[:bucket],
            max_query_len=1, max_seq_len=max_model_len, block_size=block_size, max_model_len=max_model_len,
            query_start_loc_cpu=tuple(range(bucket + 1)), seq_lens_cpu=(max_model_len,) * bucket,
        )


def cuda_capture(pool: Any, device: torch.device) -> Capture:
    """Capture on a side stream into one shared memory pool (torch >= 2.1 API only)."""

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    return capture


class DecodeGraphs:
    """Captured decode forwards per bucket, and the decision of when to use them."""

    def __init__(
        self,
        forward: DecodeForward,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: Capture | None = None,
    ) -> None:
        self.forward = forward
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self.static = StaticDecodeInputs.allocate(self.sizes[-1], max_blocks, device)
        self._capture = capture
        self.graphs: dict[int, tuple[Replayable, torch.Tensor]] = {}
        self.num_replays = 0

    def capture_all(self, warmup: int = 2) -> float:
        """Capture every bucket, largest first (the memory pool is sized once, smaller graphs
        reuse it). Each bucket runs eagerly first, twice: a backend may settle its per-step
        plan (the triton backend learns the head shape in its first forward, then picks its
        split count) and Triton must compile every variant outside the capture.
        Returns the seconds spent."""
        import time

        t0 = time.perf_counter()
        capture = self._capture
        if capture is None:
            capture = cuda_capture(torch.cuda.graph_pool_handle(), self.device)
        for bucket in reversed(self.sizes):
            batch = self.static.batch_for(bucket, self.block_size, self.max_model_len)
            ids = self.static.input_ids[:bucket].view(1, -1)
            pos = self.static.positions[:bucket].view(1, -1)

            def run(ids: torch.Tensor = ids, pos: torch.Tensor = pos, batch: PagedBatch = batch) -> torch.Tensor:
                return self.forward(ids, pos, batch)

            for _ in range(warmup):
                run()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.graphs[bucket] = capture(run)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        log.info("captured %d decode graphs (batch sizes %s) in %.1fs", len(self.graphs), self.sizes, elapsed)
        return elapsed

    def bucket_for(self, batch: PagedBatch) -> int | None:
        """The bucket that replays this step, or None: eager (mixed step, too big, not captured)."""
        if not self.graphs or not is_decode_only(batch):
            return None
        bucket = pick_bucket(batch.num_reqs, self.sizes)
        return bucket if bucket in self.graphs else None

    def run(self, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """Replay ``bucket``'s graph on this step's inputs; logits of the real rows [num_reqs, vocab]."""
        self.static.fill(bucket, input_ids, positions, batch)
        graph, out = self.graphs[bucket]
        graph.replay()
        self.num_replays += 1
        return out[: batch.num_reqs]


class EagerReplay:
    """A stand-in for a CUDA graph on the CPU: replay re-runs the captured function, which
    reads the same static buffers a real graph would. Tests use it to check that every
    input reaches the forward through those buffers."""

    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.fn = fn
        self.out = out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
    out = fn().clone()
    return EagerReplay(fn, out), out


def graph_memory_estimate(sizes: list[int], vocab_size: int, logits_bytes: int, activation_peak_bytes: int,
                          profiled_tokens: int) -> int:
    """Bytes the captured graphs keep on the GPU, reserved before the KV cache is sized:
    each bucket's output logits stay alive, and the shared pool holds the largest
    bucket's activations (scaled from the profiled peak, which ran ``profiled_tokens``)."""
    if not sizes:
        return 0
    outputs = sum(sizes) * vocab_size * logits_bytes
    activations = activation_peak_bytes * min(1.0, sizes[-1] / max(1, profiled_tokens))
    return int(outputs + activations)


def graphs_wanted(device: torch.device, enforce_eager: bool, backend: object) -> str:
    """Why decode steps run eagerly ('' when they can replay graphs)."""
    if device.type != "cuda":
        return f"device {device.type} has no CUDA graphs"
    if enforce_eager:
        return "--enforce-eager"
    if not getattr(backend, "supports_cuda_graphs", False):
        return f"attention backend {getattr(backend, 'name', '?')!r} cannot be captured"
    layers = sorted(getattr(backend, "variant_layers", ()))
    if layers:
        return f"the attention of layers {layers[:8]} has a variant (soft-cap, sinks, a sliding window) on host-side lengths"
    return ""


def decode_forward(body: torch.nn.Module, lm_head: torch.nn.Module, backend: object,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_model_len: int) -> DecodeForward:
    """The runner's forward for a decode-only step: body, then the LM head on every row."""
    from ..model.attention import StepAttention

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        step = StepAttention(backend, backend.prepare(batch), kv_caches, max_model_len, batch)  # type: ignore[attr-defined, arg-type]
        with torch.inference_mode():
            hidden = body(input_ids=input_ids, position_ids=positions, use_cache=False,
                          ferry_meta=step).last_hidden_state
            return lm_head(hidden[0])

    return forward


def setup_decode_graphs(device: torch.device, enforce_eager: bool, backend: object, body: torch.nn.Module,
                        lm_head: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                        max_num_seqs: int, max_model_len: int, block_size: int) -> DecodeGraphs | None:
    """Captured decode graphs for the runner, or None (eager) with the reason logged. A capture
    that fails leaves the worker running eagerly rather than not at all."""
    reason = graphs_wanted(device, enforce_eager, backend)
    if reason:
        log.info("CUDA graphs off: %s", reason)
        return None
    graphs = DecodeGraphs(decode_forward(body, lm_head, backend, kv_caches, max_model_len), max_num_seqs,
                          max_model_len, block_size, device)
    before = torch.cuda.memory_reserved(device)
    try:
        graphs.capture_all()
    except Exception:
        log.exception("CUDA graph capture failed; decode steps run eagerly")
        torch.cuda.synchronize(device)
        return None
    log.info("CUDA graphs hold %.1f MiB", (torch.cuda.memory_reserved(device) - before) / 2**20)
    return graphs
