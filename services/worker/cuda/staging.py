"""One host-to-device copy per step: the step's integer metadata, staged through pinned memory.

The runner builds a step's ``PagedBatch`` and its token ids, positions and sampling
rows on the host (numpy, cheap). Shipping each as its own ``tensor.to(device)``
costs one synchronous copy from pageable memory per tensor (seven or so per
step, each a few microseconds of driver time plus a host wait). Here they are
packed byte-for-byte into one pinned buffer and sent with a single
``non_blocking`` copy; the device tensors are typed views into one device buffer
(offsets aligned to 8 bytes), so no cast kernel runs either.

Reuse: the device buffer is rewritten by the next step's copy, which the stream
orders after this step's kernels. The pinned host buffer is rewritten by the next
``stage`` on the host, which may run before this copy has happened (a step that
samples nothing ends without waiting for the GPU), so ``stage`` first waits on an
event recorded after the previous copy: it waits for that copy (and whatever was
queued before it), not for the kernels of the step that copy fed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from ..backends import PagedBatch

_ALIGN = 8


class StepStaging:
    def __init__(self, device: torch.device, capacity_bytes: int = 1 << 16) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._alloc(capacity_bytes)

    def _alloc(self, nbytes: int) -> None:
        self.capacity = nbytes
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy (CUDA only)

    def stage(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors equal to ``arrays`` (same dtypes and shapes), after one copy."""
        offsets: list[int] = []
        total = 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the pinned buffer
        if total > self.capacity:
            self._alloc(max(total, 2 * self.capacity))
        host = self.host.numpy()
        for a, off in zip(arrays, offsets, strict=True):
            host[off : off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        if total:
            self.dev[:total].copy_(self.host[:total], non_blocking=True)
            if self._pin:
                self._copied = torch.cuda.Event()
                self._copied.record()
        out = []
        for a, off in zip(arrays, offsets, strict=True):
            dtype = _TORCH_DTYPES[np.dtype(a.dtype)]
            out.append(self.dev[off : off + a.nbytes].view(dtype).view(a.shape))
        return out

    def stage_batch(self, batch: PagedBatch, extra: Sequence[np.ndarray] = ()) -> tuple[PagedBatch, list[torch.Tensor]]:
        """``batch`` (built on the host) with its tensors on the device, plus ``extra`` arrays."""
        host_tensors = [batch.query_start_loc, batch.seq_lens, batch.block_table, batch.slot_mapping]
        staged = self.stage([t.numpy() for t in host_tensors] + list(extra))
        qsl, seq_lens, table, slots = staged[:4]
        on_device = dataclasses.replace(batch, query_start_loc=qsl, seq_lens=seq_lens, block_table=table,
                                        slot_mapping=slots)
        return on_device, staged[4:]


_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}
