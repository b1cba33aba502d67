"""``python -m benchmarks.kernels.bench_decode_layers --parts body`` on the default model: both
paths run on a captured decodes-only step and are timed (no speed asserted: a benchmark)."""

from __future__ import annotations

import pytest

from benchmarks.kernels import bench_decode_layers
from services.kernels.build import load_extension


def test_body_times_both_paths_on_a_decode_step() -> None:
    if not load_extension().tiled_linear_available():
        pytest.skip("no tiled bfloat16 kernel on this CPU: no decode_layers path")
    rows = bench_decode_layers.body([1, 3], 2)
    assert [r["requests"] for r in rows] == [1, 3]
    for r in rows:
        assert r["loop_ms"] > 0 and r["one_call_ms"] > 0
        assert r["one_call_over_loop"] == round(r["one_call_ms"] / r["loop_ms"], 3)
