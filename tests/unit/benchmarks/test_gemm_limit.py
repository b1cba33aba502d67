"""The trace's GEMM limit (benchmarks/peers/gemm_limit.py): its shapes, its FLOPs, and both GEMM libraries timed."""

from __future__ import annotations

import pytest
import torch

from benchmarks.peers.gemm_limit import ModelDims, TraceShape, _rates, best_of, measure

DIMS = ModelDims(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=256)
TRACE = TraceShape(num_requests=4, prompt_tokens=10, output_tokens=3, prefill_chunk=16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_limit_counts_the_traces_flops_at_the_measured_rates(dtype: str) -> None:
    out = measure(DIMS, TRACE, dtype, threads=1, min_s=0.002, trials=1)
    shapes = out["shapes"]
    assert len(shapes) == 2 * 7 + 1  # prefill and decode for each of a layer's 7 linears, one LM head
    prefill = [s for s in shapes if s["part"] == "prefill"]
    assert {s["m"] for s in prefill} == {16}  # a chunk of 16 of the 40 prompt tokens
    q = next(s for s in prefill if s["name"] == "q_proj")
    assert q["flops"] == 2.0 * 40 * 64 * 64 * 2  # every prompt token through both layers
    decode_down = next(s for s in shapes if s["part"] == "decode" and s["name"] == "down_proj")
    assert decode_down["m"] == 4 and decode_down["flops"] == 2.0 * 4 * 2 * 2 * 128 * 64  # 2 decode steps
    head = next(s for s in shapes if s["part"] == "lm_head")
    assert head["flops"] == 2.0 * 4 * 3 * 64 * 256
    for s in shapes:
        assert s["gflop_s"] > 0 and s["via"] in ("matmul", "onednn", "tiled", "amx")
        assert s["seconds"] == pytest.approx(s["flops"] / (s["gflop_s"] * 1e9))
    assert out["output_tok_s"] == pytest.approx(4 * 3 / sum(s["seconds"] for s in shapes))
    merged = best_of(out, out)
    assert merged["output_tok_s"] == pytest.approx(out["output_tok_s"])


def test_both_libraries_are_timed_where_onednn_runs() -> None:
    rates = _rates(32, 64, 96, torch.float32, 0.002, 1)
    want = {"matmul", "onednn"} if torch.backends.mkldnn.is_available() else {"matmul"}
    assert set(rates) == want and all(r > 0 for r in rates.values())


def test_ferrys_tiled_kernel_is_timed_in_bfloat16_where_it_runs() -> None:
    from benchmarks.peers.gemm_limit import _tiled_kernels

    rates = _rates(32, 64, 96, torch.bfloat16, 0.002, 1)
    assert ("tiled" in rates) == (_tiled_kernels() is not None) and all(r > 0 for r in rates.values())
    assert "tiled" not in _rates(32, 64, 96, torch.float32, 0.002, 1)
    assert "tiled" not in _rates(32, 64, 40, torch.bfloat16, 0.002, 1)  # N not a multiple of 16


def test_ferrys_amx_products_are_timed_where_the_cpu_has_them() -> None:
    """On a CPU with AMX the limit also times ferry's AMX tile products (what its linears call
    there past 6 rows), for shapes whose N and K are multiples of 32."""
    from benchmarks.peers.gemm_limit import _tiled_kernels

    kernels = _tiled_kernels()
    amx = kernels is not None and bool(kernels.tiled_amx(-1))
    rates = _rates(64, 64, 96, torch.bfloat16, 0.002, 1)
    assert ("amx" in rates) == amx and all(r > 0 for r in rates.values())
    assert "amx" not in _rates(64, 64, 80, torch.bfloat16, 0.002, 1)  # N not a multiple of 32
    assert "amx" not in _rates(64, 64, 96, torch.float32, 0.002, 1)
