"""Handing memory that a process has freed back to the kernel (glibc), for the gateway and the worker.

glibc keeps freed chunks in its heap and per-thread arenas for reuse instead of
returning them to the kernel, so a start-up that allocates and frees a lot (a worker
converting and repacking weights, a gateway parsing a 3.5 MB ``tokenizer.json``)
stays that much larger for the life of the process: ~200 MiB for a SmolLM2-135M
worker, ~29 MiB for its gateway. ``malloc_trim(0)`` releases every whole free page;
it never touches memory in use. No torch here (the gateway imports this).

The opposite holds for a model step's buffers: a 2,048-token prompt step allocates
and frees tens of MiB per layer (a gate/up product alone is 12 MiB), and by default
glibc hands such chunks back to the kernel (mmap/munmap above its mmap threshold,
and trimming the heap's top above its trim threshold), so the next layer's buffers
are fresh pages again: ~400,000 page faults (each a zeroed 4 KiB page) per common-load
run of a SmolLM2 worker, about a second of kernel time on 2 cores.
``keep_freed_memory`` sets both thresholds so such chunks stay in the heap for reuse
(docs/worker.md and docs/benchmarks.md, "Step buffers and page faults").
"""

from __future__ import annotations

import ctypes
import logging
import os

import psutil

from shared import envs

log = logging.getLogger("ferry.heap")


def is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None  # musl and macOS have no such name
    except (ValueError, OSError, AttributeError):
        return False


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def release_freed_memory() -> int | None:
    """glibc's ``malloc_trim(0)``; the resident memory it saved, in bytes (0 or more).

    None where the C library is not glibc or the call is unavailable. Never raises:
    a process that keeps some freed memory still works.
    """
    if not is_glibc():
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
        before = rss_bytes()
        trim(0)
        return max(0, before - rss_bytes())
    except Exception as exc:  # noqa: BLE001 - trimming is an optimisation, never a failure
        log.warning("malloc_trim unavailable (%s)", exc)
        return None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
MAX_HEAP_CHUNK_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
KEEP_FREE_BYTES = 1 << 30  # free heap top kept before trimming: more than any step's buffers


def keep_freed_memory(max_chunk_bytes: int = MAX_HEAP_CHUNK_BYTES, keep_bytes: int = KEEP_FREE_BYTES) -> bool:
    """Serve allocations up to ``max_chunk_bytes`` from the heap and keep up to ``keep_bytes``
    of free heap top instead of trimming it, so a step's freed buffers are reused by the
    next step without page faults. Whether glibc took both settings.

    Peak RSS does not move (those pages were resident while in use); RSS after a large
    step stays at that step's high-water mark instead of falling back. An explicit
    ``release_freed_memory`` still trims everything free. Off with ``FERRY_MALLOC_KEEP=0``;
    a no-op outside glibc. Never raises."""
    if not envs.MALLOC_KEEP.get() or not is_glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        return bool(mallopt(M_MMAP_THRESHOLD, max_chunk_bytes) == 1 and mallopt(M_TRIM_THRESHOLD, keep_bytes) == 1)
    except Exception as exc:  # noqa: BLE001 - an optimisation, never a failure
        log.warning("mallopt unavailable (%s)", exc)
        return False


def release_and_log(moment: str, logger: logging.Logger = log) -> int | None:
    """``release_freed_memory`` with one log line saying when and how much."""
    released = release_freed_memory()
    if released is not None:
        logger.info("%s: malloc_trim released %d MiB, RSS now %d MiB", moment, released >> 20, rss_bytes() >> 20)
    return released
