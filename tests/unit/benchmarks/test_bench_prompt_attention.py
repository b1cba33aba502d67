"""``python -m benchmarks.kernels.bench_prompt_attention``: two builds of the prompt kernel side by
side, on random inputs and in the model (no speed asserted: a benchmark)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.kernels import bench_prompt_attention as bench


def test_lengths_and_sources() -> None:
    assert bench._lengths("200x3,48") == [200, 200, 200, 48]
    label, texts = bench._sources(str(bench._csrc()))  # a directory
    assert label == str(bench._csrc()) and set(texts) == {bench.KERNEL, *bench.HEADERS}
    assert "prefill_attention_paged" in texts[bench.KERNEL]
    _, at_head = bench._sources("HEAD")  # a git revision
    assert "prefill_attention_paged" in at_head[bench.KERNEL] and "parallel_by_cost" in at_head["work_split.h"]
    with pytest.raises(SystemExit, match="no-such-revision"):
        bench._sources("no-such-revision")


class _Counting:
    def __init__(self, mod: Any) -> None:
        self.mod, self.calls = mod, 0

    def __getattr__(self, name: str) -> Any:
        self.calls += 1
        return getattr(self.mod, name)


def test_kernel_and_model_parts_run_both_builds() -> None:
    """The working tree's own kernel as the other version: the same outputs bit for bit, each
    close to float32 SDPA; in the model, the other build's prompt kernels really run in its turns."""
    texts = bench._sources(str(bench._csrc()))[1]
    mods = {"against": bench.build(texts), "new": bench.build(texts)}
    [row] = bench.kernel(mods, ["40x2,17"], layers=2, rounds=1, heads=4, kv_heads=2, head_dim=64)
    assert row["against_ms"] > 0 and row["new_ms"] > 0 and row["max_diff_between"] == 0
    assert row["new_max_err_vs_sdpa"] < 3e-2 and row["against_max_err_vs_sdpa"] < 3e-2
    other = _Counting(mods["against"])
    out = bench.model(other, runs=2, num_prompts=3, prompt_len=24, max_tokens=3)
    assert other.calls >= 2 * 30  # a prompt step per run, every layer
    for name in ("against", "new"):
        assert len(out["runs"][name]) == 2
        assert out[f"{name}_median"]["out_tok_s"] > 0 and out[f"{name}_median"]["prompt_steps_s"] > 0
