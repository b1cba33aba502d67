"""A process that keeps a core busy beside a kernel under test (csrc/work_split.h).

The CPU kernels split their work between two threads and a thread done with its own share
takes the other's; with another process taking a core at random, many items change thread,
which is what the tests of that split need to see happen.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def two_threads_beside_a_busy_process() -> Iterator[None]:
    """torch on two threads while a spinning process competes for the cores; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()
        torch.set_num_threads(threads)


def same_bits_with_work_taken(kernels: Any, run: Callable[[], Sequence[torch.Tensor]],
                              rounds: int = 10) -> Sequence[torch.Tensor]:
    """``run()``'s outputs with the kernels' work split once (``work_stealing(False)``), after
    checking that ``rounds`` runs with work taken between the threads, beside a busy process,
    give the same bits."""
    with two_threads_beside_a_busy_process():
        try:
            kernels.work_stealing(False)
            once = run()
            kernels.work_stealing(True)
            for _ in range(rounds):
                for got, want in zip(run(), once, strict=True):
                    assert torch.equal(got, want)
        finally:
            kernels.work_stealing(True)
    return once
