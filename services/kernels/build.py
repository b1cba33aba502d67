"""Building and loading ferry's CPU kernels: one C++ extension from ``csrc/``.

The extension is compiled on first use with the machine's own instruction set
(``-march=native``, or ``FERRY_CPU_MARCH``) into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), keyed by the source and
this CPU's flags so a cache shared with another CPU is never loaded; later starts load it in
well under a second. ``make kernels`` (``python -m services.kernels.build``) builds it ahead of
the first worker start. Without a C++ compiler the load raises and the layers keep PyTorch's
ops (the attention backend ``auto`` falls back to the reference).

Both attention kernels, the fused ops and the linear kernels come in AVX-512 and AVX2/FMA
versions (``-march`` picks one; ``kernel_isa()`` says which was built), with plain loops
for a CPU with neither.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
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


def cpu_march() -> str:
    """The ``-march`` the kernels are built for: ``FERRY_CPU_MARCH``, default ``native``.

    ``x86-64-v3`` (AVX2 and FMA, no AVX-512) builds the kernels an AVX2-only CPU runs, on
    any newer one: with ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``ATEN_CPU_CAPABILITY=avx2`` for
    torch's own kernels, that is how the AVX2 paths are tested on an AVX-512 machine; a
    container image for a mixed fleet can use it too.
    """
    march = os.environ.get("FERRY_CPU_MARCH", "").strip() or "native"
    if not all(c.isalnum() or c in "-_." for c in march):
        raise ValueError(f"FERRY_CPU_MARCH={march!r} is not a -march value")
    return march


def cflags(march: str) -> list[str]:
    # -fno-trapping-math: no floating-point exception flags to preserve, so the portable
    # loops' selects vectorize; values and rounding are unchanged
    return ["-O3", f"-march={march}", "-fopenmp", "-fno-trapping-math"]


@cache
def load_extension() -> Any:
    """Build (once per source and CPU) and load ferry's CPU kernels; raises where no compiler can."""
    from torch.utils.cpp_extension import load_inline

    sources = [p.read_text() for p in SOURCES]
    header = "".join((CSRC / h).read_text() for h in HEADERS)
    flags = cflags(cpu_march())
    key = hashlib.sha256(("".join(sources) + header + _cpu_flags() + " ".join(flags) + torch.__version__)
                         .encode()).hexdigest()[:12]
    t0 = time.monotonic()
    module = load_inline(
        name=f"ferry_cpu_kernels_{key}", cpp_sources=sources, functions=FUNCTIONS,
        extra_cflags=flags, extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(CSRC)], verbose=False,
    )
    log.info("CPU kernels (paged decode, prefill attention, fused ops, int8 quantization, tiled bfloat16 linear) ready in %.1fs", time.monotonic() - t0)
    return module


def prebuild() -> None:
    """``make kernels``: build the kernels ahead of the first worker start (never fails)."""
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        load_extension()
    except Exception as exc:  # noqa: BLE001 - report, never fail an install over an optional kernel
        print(f"CPU kernels not built ({exc}); workers on the CPU will use PyTorch's ops and the reference backend",
              file=sys.stderr)


if __name__ == "__main__":
    prebuild()
