"""Building and loading ferry's CPU kernels: one C++ extension from ``csrc/``, in four builds.

The kernels dispatch at compile time on the instruction sets the compiler may use, so they
are built once per level ferry has code for (``ISA_BUILDS``: AVX2, AVX-512, AVX-512 with
BF16, AMX), each with its own ``-m`` flags rather than ``-march=native``, so a build made on
one CPU runs on any CPU that has its level's flags. At run time ``load_extension`` takes the
widest build this CPU's flags (/proc/cpuinfo) allow and logs which. ``FERRY_CPU_MARCH``
names another: a build (``avx2``, ``avx512``, ``avx512_bf16``, ``amx``) or a ``-march`` value
(``native``: for this CPU alone; ``x86-64-v3``...); a CPU without AVX2 takes ``native``.

``make kernels`` (``python -m services.kernels.build``) builds all four ahead of the first
worker start, into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), keyed by the sources and the flags; a build missing there is
compiled on first use. Without a C++ compiler the load raises and the layers keep PyTorch's
ops (the attention backend ``auto`` falls back to the reference).

Prebuilt: ``python -m services.kernels.build --compile-only --out DIR avx2 avx512 avx512_bf16
amx`` compiles the named builds into ``DIR`` without loading any (the build machine need not
run them), one ``<module_name(build)>.so`` each; a worker with ``FERRY_KERNELS_DIR=DIR``
imports the file of its build from there, with no compiler, and compiles only a build that
``DIR`` lacks. A build's name (``module_name``) is its level, a hash of the sources, the flags
and torch's version: never the build machine's CPU, so a build made on one machine is found on
every other (a ``native`` build alone adds the CPU's flags, as it runs on this CPU alone).
The deployment image carries the four (deploy/Dockerfile).

Both attention kernels, the fused ops and the linear kernels come in AVX-512 and AVX2/FMA
versions (``kernel_isa()`` says which was built), with plain loops for a CPU with neither;
the tiled bfloat16 linear needs AVX512-BF16, the tile products AMX.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("ferry.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / f for f in ("paged_decode.cpp", "prefill_attention.cpp", "fused_ops.cpp", "int8_ops.cpp",
                                   "tiled_linear.cpp", "decode_layers.cpp"))
HEADERS = ("vec512.h", "vec256.h", "work_split.h", "pool.h", "amx.h")
FUNCTIONS = ["paged_decode", "write_kv", "prefill_attention", "prefill_attention_available", "prefill_attention_paged", "prefill_amx",
             "rms_norm", "add_rms_norm",
             "silu_and_mul", "rotary", "argmax_rows", "sample_rows", "race_rows", "fused_ops_available", "to_bfloat16", "quant_rows", "dequant_rows", "kernel_isa",
             "tiled_linear_available", "tiled_pack", "tiled_embedding", "tiled_linear", "tiled_silu_linear", "tiled_prefetch", "work_stealing", "pool_check",
             "amx_linear", "amx_silu_linear", "amx_rope_linear", "amx_rope", "tiled_amx", "amx_linear_rows",
             "decode_layers"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_flag(name: str) -> bool:
    """Whether this CPU lists ``name`` among its flags (/proc/cpuinfo)."""
    return name in _cpu_flags().split()


@dataclass(frozen=True)
class IsaBuild:
    name: str
    march: tuple[str, ...]  # the compiler's -m flags
    needs: frozenset[str]  # the /proc/cpuinfo flags of every instruction those flags allow the code


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_BF16 = _V4 | {"avx512_bf16", "avx512vbmi", "avx512_vnni"}
_BF16_MARCH = ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vbmi", "-mavx512vnni")
# lowest first; tuned (-mtune: scheduling only, any CPU of the level runs it) for the CPUs their
# paths were measured on: the Zen 3 EPYC (AVX2), the AMX Xeon
ISA_BUILDS = (
    IsaBuild("avx2", ("-march=x86-64-v3", "-mtune=znver3"), _V3),
    IsaBuild("avx512", ("-march=x86-64-v4", "-mtune=icelake-server"), _V4),
    IsaBuild("avx512_bf16", _BF16_MARCH, _BF16),  # (-mtune=znver4 needs GCC 13)
    IsaBuild("amx", (*_BF16_MARCH, "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mtune=sapphirerapids"),
             _BF16 | {"amx_tile", "amx_bf16", "amx_int8"}),
)
BUILDS = {b.name: b for b in ISA_BUILDS}


def runnable_builds(flags: frozenset[str] | None = None) -> list[str]:
    """The builds whose instructions this CPU (or ``flags``) executes, lowest first."""
    have = frozenset(_cpu_flags().split()) if flags is None else flags
    return [b.name for b in ISA_BUILDS if b.needs <= have]


def cpu_march() -> str:
    """The build to load: ``FERRY_CPU_MARCH`` (a build's name or a ``-march`` value) where set,
    else the widest of ``ISA_BUILDS`` this CPU runs, else ``native``.

    ``avx2`` (or ``x86-64-v3``) builds the kernels an AVX2-only CPU runs, on any newer one:
    with ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``ATEN_CPU_CAPABILITY=avx2`` for torch's own
    kernels, that is how the AVX2 paths are tested on an AVX-512 machine.
    """
    march = os.environ.get("FERRY_CPU_MARCH", "").strip()
    if not march:
        runnable = runnable_builds()
        return runnable[-1] if runnable else "native"
    if not all(c.isalnum() or c in "-_." for c in march):
        raise ValueError(f"FERRY_CPU_MARCH={march!r} is not a -march value")
    return march


def cflags(march: str) -> list[str]:
    """The compiler flags of a build (``ISA_BUILDS``' name) or of a ``-march`` value."""
    # -fno-trapping-math: no floating-point exception flags to preserve, so the portable
    # loops' selects vectorize; values and rounding are unchanged
    arch = list(BUILDS[march].march) if march in BUILDS else [f"-march={march}"]
    return ["-O3", *arch, "-fopenmp", "-fno-trapping-math"]


def load_extension(march: str | None = None) -> Any:
    """Build (once per source and flags) and load ferry's CPU kernels, as ``march`` (a build's
    name or a ``-march`` value; default ``cpu_march()``); raises where no compiler can."""
    return _load(march or cpu_march())


def module_name(march: str, cpu: str | None = None) -> str:
    """The extension module's (and its file's) name for a build (``ISA_BUILDS``' name) or a
    ``-march`` value: the level and a hash of the sources, the flags and torch's version. An
    ISA build's name never depends on the CPU it is made on; a ``-march`` value's also hashes
    the CPU's flags (``cpu``, default /proc/cpuinfo's), so a shared cache never hands a
    ``native`` build to another CPU."""
    sources = "".join(p.read_text() for p in SOURCES)
    header = "".join((CSRC / h).read_text() for h in HEADERS)
    if march in BUILDS:
        cpu = ""
    elif cpu is None:
        cpu = _cpu_flags()
    key = hashlib.sha256((sources + header + cpu + " ".join(cflags(march)) + torch.__version__)
                         .encode()).hexdigest()[:12]
    label = "".join(c if c.isalnum() else "_" for c in march)
    return f"ferry_cpu_kernels_{label}_{key}"


def kernels_dir() -> Path | None:
    """``FERRY_KERNELS_DIR``: the folder of prebuilt builds (``compile_only``), or None."""
    folder = os.environ.get("FERRY_KERNELS_DIR", "").strip()
    return Path(folder) if folder else None


def prebuilt_path(march: str, folder: Path | None = None) -> Path | None:
    """The prebuilt file of ``march`` in ``folder`` (default ``FERRY_KERNELS_DIR``), if there."""
    folder = folder or kernels_dir()
    if folder is None:
        return None
    path = folder / f"{module_name(march)}.so"
    return path if path.is_file() else None


def _import_file(name: str, path: Path) -> Any:
    """Import an extension module from its file: no compiler, no ninja, no build folder."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {name} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def _load(march: str) -> Any:
    flags = cflags(march)
    name = module_name(march)
    t0 = time.monotonic()
    folder = kernels_dir()
    module, path = None, folder / f"{name}.so" if folder else None
    if path is not None and path.is_file():
        try:
            module = _import_file(name, path)
            how = f"prebuilt, {folder}"
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: compile as without one
            log.warning("CPU kernels: the prebuilt %s cannot be imported (%s); compiling the %s build", path, exc, march)
    if module is None:
        from torch.utils.cpp_extension import _get_build_directory, load_inline

        built = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
        before = built.stat().st_mtime_ns if built.is_file() else None  # torch recompiles on a changed command
        module = load_inline(
            name=name, cpp_sources=[p.read_text() for p in SOURCES], functions=FUNCTIONS,
            extra_cflags=flags, extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)], verbose=False,
        )
        cached = before is not None and built.is_file() and built.stat().st_mtime_ns == before
        how = "from torch's extension cache" if cached else "built now"
        if folder is not None:
            how += f", no usable prebuilt one in {folder}"
    log.info("CPU kernels: the %s build (%s; %s paths; %s) ready in %.1fs; this CPU runs %s", march,
             " ".join(flags[1:-2]), module.kernel_isa(), how, time.monotonic() - t0,
             ", ".join(runnable_builds()) or "none of the ISA builds")
    return module


def _main_cpp() -> str:
    """The one translation unit ``load_inline`` compiles: torch's header, the sources and the
    Python bindings of ``FUNCTIONS`` (with torch's error handling, as ``load_inline`` writes them)."""
    binds = [f'm.def("{f}", torch::wrap_pybind_function({f}), "{f}");' for f in FUNCTIONS]
    return "\n".join(["#include <torch/extension.h>", *(p.read_text() for p in SOURCES),
                      "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {", *binds, "}"])


def compile_only(march: str, out: Path) -> Path:
    """Compile a build into ``out`` as ``<module_name(march)>.so`` without loading it (this
    machine need not run its instructions); returns the file. Needs a C++ compiler and ninja."""
    from torch.utils.cpp_extension import _write_ninja_file_and_build_library

    if march not in BUILDS:
        raise ValueError(f"{march!r} is not one of the builds {', '.join(BUILDS)}: only those are prebuilt")
    name = module_name(march)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{name}.so"
    with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=out) as tmp:
        main = Path(tmp) / "main.cpp"
        main.write_text(_main_cpp())
        _write_ninja_file_and_build_library(
            name=name, sources=[str(main)], extra_cflags=cflags(march), extra_cuda_cflags=[],
            extra_sycl_cflags=[], extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)],
            build_directory=tmp, verbose=False, with_cuda=False, with_sycl=False)
        built = Path(tmp) / f"{name}.so"
        shutil.copyfile(built, Path(tmp) / "done.so")
        os.replace(Path(tmp) / "done.so", target)  # whole or absent: a reader never sees half a file
    return target


def prebuild(names: list[str] | None = None) -> None:
    """``make kernels``: build every ISA build this CPU runs (or ``names``; with ``FERRY_CPU_MARCH``
    set, that one) ahead of the first worker start (never fails)."""
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if names is None:
        march = os.environ.get("FERRY_CPU_MARCH", "").strip()
        names = [march] if march else runnable_builds() or ["native"]
    for name in names:
        try:
            load_extension(name)
        except Exception as exc:  # noqa: BLE001 - report, never fail an install over an optional kernel
            print(f"CPU kernels ({name}) not built ({exc}); workers on the CPU will use PyTorch's ops and the "
                  "reference backend", file=sys.stderr)


def main(argv: list[str]) -> int:
    """``python -m services.kernels.build [BUILD...]``: build and load (``prebuild``);
    ``--compile-only --out DIR BUILD...``: compile each into DIR, loading none (fails on an error)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m services.kernels.build", description=main.__doc__)
    parser.add_argument("builds", nargs="*", help=f"builds ({', '.join(BUILDS)}) or -march values")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the named builds (default: all four) into --out without loading them")
    parser.add_argument("--out", type=Path, help="the folder of --compile-only's files (FERRY_KERNELS_DIR)")
    args = parser.parse_args(argv)
    if not args.compile_only:
        if args.out:
            parser.error("--out goes with --compile-only")
        prebuild(args.builds or None)
        return 0
    if args.out is None:
        parser.error("--compile-only needs --out DIR")
    for name in args.builds or list(BUILDS):
        t0 = time.monotonic()
        path = compile_only(name, args.out)
        print(f"CPU kernels: the {name} build compiled into {path} in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
