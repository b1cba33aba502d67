"""Prebuilt kernel builds (services/kernels/build.py): ``--compile-only`` writes a build's file
without loading it, a worker with ``FERRY_KERNELS_DIR`` imports it with no compiler, and a
build's name depends on the sources, flags and torch's version, never on the CPU it is made on.

One build is compiled here (avx2: the cheapest, and any x86-64-v3 CPU runs it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from services.kernels import build
from services.kernels.build import BUILDS, module_name, prebuilt_path, runnable_builds

ROOT = Path(__file__).resolve().parents[3]


def test_a_builds_name_does_not_depend_on_the_cpu_it_is_made_on(monkeypatch: pytest.MonkeyPatch) -> None:
    names = {b: module_name(b) for b in BUILDS}
    monkeypatch.setattr(build, "_cpu_flags", lambda: "flags : fpu sse2 avx avx2 fma avx512f amx_tile")
    assert {b: module_name(b) for b in BUILDS} == names
    monkeypatch.setattr(build, "_cpu_flags", lambda: "flags : fpu sse2")
    assert {b: module_name(b) for b in BUILDS} == names
    assert len(set(names.values())) == len(BUILDS)
    assert all(n.startswith(f"ferry_cpu_kernels_{b}_") and n.isidentifier() for b, n in names.items())
    # a -march value's build runs on its CPU alone: the CPU's flags join its name
    assert module_name("native", cpu="flags : avx2") != module_name("native", cpu="flags : avx512f")


def test_a_builds_name_changes_with_the_sources_and_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = module_name("avx2")
    edited = tmp_path / "fused_ops.cpp"
    edited.write_text(build.SOURCES[2].read_text() + "\n// an edit\n")
    monkeypatch.setattr(build, "SOURCES", (*build.SOURCES[:2], edited, *build.SOURCES[3:]))
    assert module_name("avx2") != before
    monkeypatch.undo()
    assert module_name("avx2") == before
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert module_name("avx2") != before


def test_only_a_file_named_for_the_build_is_prebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FERRY_KERNELS_DIR", raising=False)
    assert prebuilt_path("avx2") is None
    assert prebuilt_path("avx2", tmp_path) is None
    (tmp_path / "ferry_cpu_kernels_avx2_000000000000.so").write_bytes(b"")  # another source's build
    assert prebuilt_path("avx2", tmp_path) is None
    (tmp_path / f"{module_name('avx2')}.so").write_bytes(b"")
    monkeypatch.setenv("FERRY_KERNELS_DIR", str(tmp_path))
    assert prebuilt_path("avx2") == tmp_path / f"{module_name('avx2')}.so"
    assert prebuilt_path("avx512") is None


def test_compile_only_takes_only_the_isa_builds(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not one of the builds"):
        build.compile_only("native", tmp_path)
    assert not any(tmp_path.iterdir())


_LOAD = textwrap.dedent("""
    import logging, shutil, sys
    import torch
    assert not any(shutil.which(c) for c in ("g++", "c++", "gcc", "cc", "clang++", "ninja")), "a compiler is on PATH"
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    from services.kernels.build import load_extension
    k = load_extension("avx2")
    print("FILE", k.__file__)
    assert k.kernel_isa() == "avx2"
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen)
    w = 1 + 0.1 * torch.randn(64, generator=gen)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(k.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-5)
    gu = torch.randn(5, 128, generator=gen)
    torch.testing.assert_close(k.silu_and_mul(gu), torch.nn.functional.silu(gu[:, :64]) * gu[:, 64:])
    print("OK")
""")


@pytest.mark.compiles
@pytest.mark.skipif("avx2" not in runnable_builds(), reason="this CPU does not run the avx2 build")
def test_a_compiled_build_loads_with_no_compiler(tmp_path: Path) -> None:
    out = tmp_path / "kernels"
    compiled = subprocess.run(
        [sys.executable, "-m", "services.kernels.build", "--compile-only", "--out", str(out), "avx2"],
        cwd=ROOT, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")},
        capture_output=True, text=True, timeout=900)
    assert compiled.returncode == 0, compiled.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == [f"{module_name('avx2')}.so"]  # no build folder left
    assert not (tmp_path / "cache").exists()  # compiled, never loaded through torch's cache

    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC", "FERRY_CPU_MARCH")}
    empty = tmp_path / "bin"
    empty.mkdir()
    env |= {"PATH": str(empty), "FERRY_KERNELS_DIR": str(out), "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache2"),
            "PYTHONPATH": str(ROOT)}
    loaded = subprocess.run([sys.executable, "-c", _LOAD], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stdout[-2000:] + loaded.stderr[-4000:]
    assert f"FILE {out / module_name('avx2')}.so" in loaded.stdout
    assert "the avx2 build" in loaded.stdout and f"prebuilt, {out}" in loaded.stdout
    assert loaded.stdout.rstrip().endswith("OK")


class _Built:
    def kernel_isa(self) -> str:
        return "avx2"


@pytest.mark.parametrize("folder", ["none", "empty", "damaged", "cached", "recompiled"])
def test_without_a_usable_prebuilt_file_the_build_is_compiled(folder: str, monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch.utils.cpp_extension

    compiled: list[str] = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch-ext"))
    cache_file = Path(torch.utils.cpp_extension._get_build_directory(module_name("avx2"), verbose=False)) / (
        f"{module_name('avx2')}.so")

    def load_inline(name: str, **_: object) -> _Built:
        compiled.append(name)
        if folder == "recompiled":  # torch compiles again over a cached file (its command changed)
            cache_file.write_bytes(b"new")
            os.utime(cache_file, ns=(0, cache_file.stat().st_mtime_ns + 10**9))
        return _Built()

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", load_inline)
    monkeypatch.delenv("FERRY_KERNELS_DIR", raising=False)
    if folder in ("cached", "recompiled"):  # compiled before into torch's extension cache
        cache_file.write_bytes(b"")
    if folder in ("empty", "damaged"):
        monkeypatch.setenv("FERRY_KERNELS_DIR", str(tmp_path))
    if folder == "damaged":
        (tmp_path / f"{module_name('avx2')}.so").write_bytes(b"not an ELF file")
    with caplog.at_level("INFO", logger="ferry.kernels"):
        build._load.__wrapped__("avx2")
    assert compiled == [module_name("avx2")]
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU kernels: the avx2 build")]
    assert len(line) == 1
    expected = {"none": "built now)", "recompiled": "built now)", "cached": "from torch's extension cache)"}.get(
        folder, f"built now, no usable prebuilt one in {tmp_path})")
    assert expected in line[0]
    assert ("cannot be imported" in caplog.text) == (folder == "damaged")
