"""The pieces of ``benchmarks.kernels.bench_kernels_ab`` that decide what it reports."""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import pytest
import torch

from benchmarks.kernels import bench_kernels_ab as ab


def test_alternate_takes_each_rounds_best_of_three_and_the_median_in_alternating_order() -> None:
    calls: list[str] = []
    a = itertools.cycle([5.0, 1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 7.0, 7.0])  # bests 1, 2, 7 -> median 2
    b = itertools.cycle([4.0])

    def fa() -> float:
        calls.append("a")
        return next(a)

    def fb() -> float:
        calls.append("b")
        return next(b)

    got = ab.alternate({"a": fa, "b": fb}, rounds=3)
    assert got == {"a": 2.0, "b": 4.0}
    # round 0: a then b; round 1: b then a; round 2: a then b (three calls each)
    assert "".join(calls) == "aaabbb" + "bbbaaa" + "aaabbb"


def test_tables_for_gives_each_request_its_own_blocks() -> None:
    lens = [1, 16, 17, 4000]
    table = ab.tables_for(lens, blocks=400, gen=torch.Generator().manual_seed(0))
    need = [1, 1, 2, 250]
    assert table.shape == (4, 250) and table.dtype == torch.int32
    used = torch.cat([table[i, :k] for i, k in enumerate(need)])
    assert used.unique().numel() == sum(need) and int(used.max()) < 400


def test_same_bits_compares_bytes_not_values() -> None:
    x = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    assert ab.same_bits(x, x.clone())
    assert not ab.same_bits(x, torch.tensor([-0.0, 1.0], dtype=torch.bfloat16))  # equal values, other bits
    assert not ab.same_bits(x, x[:1])


def test_refuses_this_tree_as_its_own_base() -> None:
    with pytest.raises(SystemExit, match="this tree"):
        ab.main(["--base", str(Path(ab.__file__).resolve().parents[2])])


@pytest.mark.parametrize("through_fma", [False, True])
def test_decode_dot_modes(monkeypatch: pytest.MonkeyPatch, through_fma: bool) -> None:
    from services.worker.backends import cpu_paged

    monkeypatch.setattr(cpu_paged, "bf16_decode_through_fma", lambda: through_fma)
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn

    def dot(mode: str, name: str, dtype: torch.dtype) -> bool:
        return ab.decode_dot(argparse.Namespace(dot=mode), name, dtype)

    for name in ("base", "this"):  # on: dot products in both trees, whatever the CPU
        assert dot("on", name, bf16) and dot("on", name, fp8)
    # auto: the base tree keeps dot products, this tree follows the backend's rule
    assert dot("auto", "base", bf16)
    assert dot("auto", "this", bf16) is not through_fma
    # rule: both trees follow it (float8 keeps dot products either way)
    for name in ("base", "this"):
        assert dot("rule", name, bf16) is not through_fma
        assert dot("rule", name, fp8)
    # and rule is what a run without --dot measures: the path the engine takes on this CPU
    default = ab.parser().parse_args(["--base", "/tmp/elsewhere"])
    assert default.dot == "rule"
    assert ab.decode_dot(default, "base", bf16) is not through_fma


def test_linear_part_times_every_projection_at_every_row_count() -> None:
    """``--parts linear``: each projection at each row count, both builds' outputs compared bit
    for bit (one build against itself here: identical), times and rows as asked."""
    from services.kernels.build import load_extension

    k = load_extension()
    if not k.tiled_amx(-1):
        pytest.skip("no AMX tile products here (CPU or build)")
    args = argparse.Namespace(layers=2, rounds=1, linear_rows="33,130")
    rows = ab.run_linear({"base": k, "this": k}, args)
    assert [(r["projection"], r["rows"]) for r in rows] == [
        (name, m) for m in (33, 130) for name, _, _ in ab.LINEAR_SHAPES]
    assert all(r["bit_identical"] and r["base_ms"] > 0 and r["this_ms"] > 0 and r["layers"] == 2 for r in rows)
