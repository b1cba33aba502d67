"""The scheduler benchmark script still runs and prints its JSON summary (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.serving import bench_scheduler as bench


def test_bench_runs_small_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    bench.main(["--steps", "5", "--sizes", "8,16", "--out", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary == json.loads(out.read_text())
    for size in (8, 16):
        assert summary[f"us_per_step_{size}"] > 0
        assert summary[f"steps_per_s_{size}"] > 0
