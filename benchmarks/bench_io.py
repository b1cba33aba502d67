"""What every benchmark script's JSON starts with (``header``) and how it is written; the OpenMP policy it ran under."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any


def openmp_policy() -> dict[str, str | None]:
    """How this process's OpenMP threads wait (read by libgomp when torch loaded; benchmarks.kernels
    and benchmarks.engine set the served worker's default): a figure measured under another policy
    is not comparable."""
    return {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def header(module: str, argv: list[str] | None) -> dict[str, Any]:
    """The command as run, the machine (CPUs, platform, load average, OpenMP wait policy) and
    the date (UTC)."""
    return {
        "command": " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg(),
                    "openmp": openmp_policy()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def write_json(out: Path | None, result: dict[str, Any]) -> None:
    """``result`` to ``out`` (its folder made) when given, and say where."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
