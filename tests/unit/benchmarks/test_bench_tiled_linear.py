"""``bench_tiled_linear --parts prompt``: the measurement FERRY_CPU_AMX_PROMPT's default comes from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.worker.model.packed_linear import _tiled_kernels


def test_prompt_part_times_every_projection_on_both_kernels(tmp_path: Path) -> None:
    kernels = _tiled_kernels()
    if kernels is None or not kernels.tiled_amx(-1) or not torch.backends.mkldnn.is_available():
        pytest.skip("no AMX products here (CPU or build)")
    out = tmp_path / "prompt.json"
    # its own process: the benchmark sets the thread count and the heap's settings for its life
    subprocess.run([sys.executable, "-m", "benchmarks.kernels.bench_tiled_linear", "--parts", "prompt", "--prompt-rows",
                    "130,200", "--rounds", "1", "--threads", "1", "--out", str(out)], check=True, timeout=300)
    rows = json.loads(out.read_text())["prompt"]
    assert [r["rows"] for r in rows] == [130, 200]
    for r in rows:
        for kind in ("qkv", "o", "gate_up", "down"):
            assert r[f"{kind}_onednn_ms"] > 0 and r[f"{kind}_amx_ms"] > 0
            assert r[f"{kind}_speedup"] == pytest.approx(r[f"{kind}_onednn_ms"] / r[f"{kind}_amx_ms"], rel=0.01)
        assert r["total_amx_ms"] == pytest.approx(sum(r[f"{k}_amx_ms"] for k in ("qkv", "o", "gate_up", "down")), abs=0.05)
