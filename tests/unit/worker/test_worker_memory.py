"""The worker's memory helpers (services/worker/memory.py, shared/heap.py).

No assertion on how much RSS anything saves (that depends on the allocator's
history and on the machine); these check what the helpers return, that they
never raise, which modules a CPU worker keeps out, and the tensor census.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading

import pytest
import torch
from torch import nn

from services.worker.logits_processors import ConstraintTracker
from services.worker.memory import (
    host_tensor_bytes,
    keep_out_unused_modules,
    log_ready_memory,
    module_tensors,
)
from shared import heap


def test_cpu_worker_keeps_triton_out() -> None:
    modules: dict[str, object] = {}
    assert keep_out_unused_modules("cpu", modules) == ["triton"]
    assert modules == {"triton": None}
    assert keep_out_unused_modules("cpu", modules) == []  # already decided: nothing marked twice


def test_gpu_worker_and_imported_modules_are_left_alone() -> None:
    modules: dict[str, object] = {}
    assert keep_out_unused_modules("cuda", modules) == []
    assert keep_out_unused_modules("cuda:1", modules) == []
    assert modules == {}
    loaded = {"triton": sys}  # imported before the worker decided: stays usable
    assert keep_out_unused_modules("cpu", loaded) == []
    assert loaded["triton"] is sys


def test_a_module_marked_absent_reads_as_not_installed() -> None:
    """What torch (``import triton`` in a try) and transformers (``find_spec``) see."""
    missing = object()
    saved = sys.modules.pop("triton", missing)  # other tests may have imported it: put back below
    try:
        assert keep_out_unused_modules("cpu") == ["triton"]  # the real sys.modules
        assert importlib.util.find_spec("triton") is None
        with pytest.raises(ImportError):
            import triton  # noqa: F401
    finally:
        if saved is missing:
            sys.modules.pop("triton", None)
        else:
            sys.modules["triton"] = saved  # type: ignore[assignment]


def test_release_freed_memory_on_glibc() -> None:
    if not heap.is_glibc():
        pytest.skip("not glibc")
    garbage = [bytearray(4096) for _ in range(20_000)]  # ~80 MB of small chunks, freed below
    del garbage
    released = heap.release_freed_memory()
    assert isinstance(released, int) and released >= 0


def test_release_freed_memory_elsewhere_returns_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_glibc(name: str) -> str:
        raise ValueError(f"unrecognized configuration name {name!r}")  # what musl's Python raises

    monkeypatch.setattr(os, "confstr", no_glibc)
    assert not heap.is_glibc()
    assert heap.release_freed_memory() is None
    assert heap.release_and_log("test") is None


def test_release_freed_memory_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "is_glibc", lambda: True)

    def no_library(name: object) -> object:
        raise OSError("no such library")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert heap.release_freed_memory() is None


# A child process (mallopt settings are for the life of a process): 200 chunks of 100 KiB,
# below glibc's mmap threshold, so from the heap, written, freed; five more rounds counted.
# The freed 20 MiB at the heap's top is more than glibc's default trim threshold, so by
# default each round gets fresh pages again (one fault per 4 KiB page); kept, none.
_ROUNDS = """
import ctypes, resource, sys
from shared import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def one_round():
    chunks = [libc.malloc(100 << 10) for _ in range(200)]
    for c in chunks:
        ctypes.memset(c, 1, 100 << 10)
    for c in reversed(chunks):
        libc.free(c)
one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, env: dict[str, str] | None = None) -> int:
    import subprocess

    out = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    return int(out.stdout.split()[-1])


def test_keep_freed_memory_reuses_step_buffers_without_page_faults() -> None:
    if not heap.is_glibc():
        pytest.skip("not glibc")
    pages = 5 * 200 * (100 << 10) // 4096  # 25,000: every page of every round
    assert _faults("default") > pages // 2  # glibc's defaults hand the pages back each round
    assert _faults("keep") < pages // 50  # kept: the rounds reuse them


def test_keep_freed_memory_can_be_turned_off_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_MALLOC_KEEP", "0")
    assert heap.keep_freed_memory() is False
    monkeypatch.delenv("FERRY_MALLOC_KEEP")
    monkeypatch.setattr(heap, "is_glibc", lambda: True)

    def no_library(name: object) -> object:
        raise OSError("no such library")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert heap.keep_freed_memory() is False


def test_census_counts_each_storage_once() -> None:
    model = nn.Module()
    model.a = nn.Linear(4, 8, bias=False, dtype=torch.bfloat16)  # 64 bytes
    model.b = nn.Linear(4, 8, bias=False, dtype=torch.bfloat16)
    model.b.weight = model.a.weight  # tied: still 64
    model.register_buffer("table", torch.zeros(10), persistent=False)  # 40 bytes
    model.register_buffer("view", model.table[2:5], persistent=False)  # a view: nothing more
    model.register_buffer("elsewhere", torch.zeros(100, device="meta"))  # not host memory
    assert host_tensor_bytes(module_tensors(model)) == 64 + 40
    kv = [(torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(2, 3, dtype=torch.bfloat16))]
    assert host_tensor_bytes([t for pair in kv for t in pair]) == 2 * 12


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_census_counts_packed_weights() -> None:
    from services.worker.model.packed_linear import PackedLinear

    # float32: oneDNN packs it on any x86 CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT)
    packed = PackedLinear(nn.Linear(64, 32, bias=False, dtype=torch.float32))
    assert host_tensor_bytes(module_tensors(packed)) == packed.packed.nbytes >= 64 * 32 * 4


def test_ready_report_splits_rss_and_never_raises() -> None:
    model = nn.Linear(16, 16, bias=False)
    kv = [(torch.zeros(4, 4), torch.zeros(4, 4))]
    parts = log_ready_memory(model, kv, released=None)
    assert parts["kv_cache"] == 128 and parts["weights"] == 16 * 16 * 4
    assert parts["rest"] == parts["rss"] - 128 - 1024
    assert log_ready_memory(object(), kv, released=0) == {}  # type: ignore[arg-type]


def test_callback_once_the_tokenizer_has_loaded() -> None:
    release = threading.Event()

    def load() -> object:
        release.wait(10)
        raise RuntimeError("no tokenizer here")  # a failed load ends the wait too

    calls: list[str] = []
    called = threading.Event()
    tracker = ConstraintTracker(load)  # type: ignore[arg-type]
    try:
        tracker.when_tokenizer_loaded(lambda: (calls.append("later"), called.set()))
        assert calls == []
        release.set()
        assert called.wait(10)  # in the loading thread, right after the load ended
        with pytest.raises(RuntimeError):
            tracker.grammar_cache()
        tracker.when_tokenizer_loaded(lambda: calls.append("now"))  # already done: runs at once, here
        assert calls == ["later", "now"]
    finally:
        tracker.close()
