"""ferry's own threads for its CPU kernels (csrc/pool.h), through ``pool_check``: a parallel_for
over items that each spin a while and count how often they ran, and which threads ran them.

The caller never waits on a helper that is not there: whoever comes takes the items, each
item runs exactly once, errors come back to the caller, and a forked child gets its own helpers.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from services.worker.model import fused_ops
from tests.busy import two_threads_beside_a_busy_process


def _kernels():  # noqa: ANN202
    k = fused_ops.kernels()
    if k is None or not hasattr(k, "pool_check"):
        pytest.skip("no C++ compiler: the CPU kernels are absent")
    return k


@contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("items, item_us", [(1, 0), (2, 50), (64, 100), (1000, 0), (7, 2000)])
def test_every_item_runs_exactly_once(items: int, item_us: int) -> None:
    k = _kernels()
    with _threads(2):
        for _ in range(5):
            out = k.pool_check(items, item_us, -1)
            assert out[:items].tolist() == [1] * items
            assert 1 <= int(out[items]) <= min(2, items)


def test_a_helper_joins_long_jobs() -> None:
    """Items of 2 ms: the second thread takes part (within a few tries on a shared machine)."""
    k = _kernels()
    with _threads(2):
        joined = [int(k.pool_check(16, 2000, -1)[16]) for _ in range(10)]
    assert max(joined) == 2, joined


def test_one_thread_runs_everything_on_the_caller() -> None:
    k = _kernels()
    with _threads(1):
        out = k.pool_check(32, 10, -1)
    assert out[:32].tolist() == [1] * 32 and int(out[32]) == 1


def test_items_run_once_beside_a_busy_process() -> None:
    """With a process competing for the cores, the helper is often off its core: the caller
    takes its items instead of waiting, and no item runs twice or never."""
    k = _kernels()
    with two_threads_beside_a_busy_process():
        for _ in range(50):
            out = k.pool_check(40, 50, -1)
            assert out[:40].tolist() == [1] * 40


@pytest.mark.parametrize("fail_item", [0, 5, 63])
def test_an_error_in_any_item_reaches_the_caller_and_the_pool_goes_on(fail_item: int) -> None:
    k = _kernels()
    with _threads(2):
        with pytest.raises(RuntimeError, match=f"item {fail_item} failed as asked"):
            k.pool_check(64, 20, fail_item)
        out = k.pool_check(64, 20, -1)  # the next job runs whole
    assert out[:64].tolist() == [1] * 64


def _child(queue: multiprocessing.Queue) -> None:
    torch.set_num_threads(2)
    k = fused_ops.kernels()
    runs = [k.pool_check(16, 2000, -1) for _ in range(5)]
    queue.put(([r[:16].tolist() for r in runs], max(int(r[16]) for r in runs)))


def test_a_forked_child_runs_jobs_with_its_own_helpers() -> None:
    """The parent's helpers do not exist after fork(): the child starts its own (pthread_atfork)
    instead of waiting on them or running alone for ever."""
    k = _kernels()
    with _threads(2):
        k.pool_check(8, 10, -1)  # the parent's helpers are up
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    counts, threads = queue.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert counts == [[1] * 16] * 5 and threads == 2
