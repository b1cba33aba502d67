"""Handing memory that a process has freed back to the kernel (glibc), for the gateway and the worker.

glibc keeps freed chunks in its heap and per-thread arenas for reuse instead of
returning them to the kernel, so a start-up that allocates and frees a lot (a worker
converting and repacking weights, a gateway parsing a 3.5 MB ``tokenizer.json``)
stays that much larger for the life of the process: ~200 MiB for a SmolLM2-135M
worker, ~29 MiB for its gateway. ``malloc_trim(0)`` releases every whole free page;
it never touches memory in use. No torch here (the gateway imports this).
"""

from __future__ import annotations

import ctypes
import logging
import os

import psutil

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


def release_and_log(moment: str, logger: logging.Logger = log) -> int | None:
    """``release_freed_memory`` with one log line saying when and how much."""
    released = release_freed_memory()
    if released is not None:
        logger.info("%s: malloc_trim released %d MiB, RSS now %d MiB", moment, released >> 20, rss_bytes() >> 20)
    return released
