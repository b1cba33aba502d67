"""``bench_offline --profile``'s split of the forward (benchmarks/engine/bench_profile.py) on the
tiny model: through the lean forward and through transformers' own, the body is found, the
parts are positive where they must be, and they add up to the body."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from benchmarks.engine.bench_profile import profile_shares
from services.engine.offline import LLM, GenerationParams
from tests.conftest import cached_tiny_model
from tests.tiny_models import build_tiny_model


@pytest.mark.parametrize("lean", [True, False])
def test_profile_finds_the_body_and_its_parts(lean: bool) -> None:
    torch.set_num_threads(1)
    llm = LLM(model=str(cached_tiny_model("llama")), dtype="float32", kv_cache_memory=1 << 22, num_threads=1)
    runner = llm.runner
    assert runner.lean is not None  # a CPU worker on a Llama runs the lean forward
    params = GenerationParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [list(range(300 + 50 * i, 340 + 50 * i)) for i in range(6)]
    out = profile_shares(lambda: llm.generate(prompts, params), runner.model, runner.sampler,
                         runner.lean if lean else None, runner.attn_backend if lean else None)
    parts, body = out["parts_s"], out["body_s"]
    if lean:
        assert body > 0 and parts["linear"] > 0 and parts["attention"] > 0 and parts["rmsnorm"] > 0
        assert out["lm_head_s"] > 0
        assert abs(sum(out["shares_of_body"].values()) - 1.0) < 0.01
    else:  # transformers' forward is not what ran: nothing is found, nothing is made up
        assert body == 0.0 and all(v == 0.0 for v in out["shares_of_body"].values())


def _wide_llm(tmp_path: Path, **shape: int) -> LLM:
    """A bfloat16 Llama with a wide MLP (4,096) on the tiled kernels, one thread; skips without them."""
    from services.kernels.build import load_extension

    if not load_extension().tiled_linear_available():
        pytest.skip("no AVX512-BF16 tiled linear on this CPU")
    torch.set_num_threads(1)
    folder = build_tiny_model(tmp_path / "wide", "llama", intermediate_size=4096, num_key_value_heads=2, head_dim=64,
                              **shape)
    return LLM(model=str(folder), dtype="bfloat16", kv_cache_memory=1 << 24, num_threads=1)


def test_the_gated_products_count_as_linear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 on the tiled kernel: the gate/up product with its activation fused in is one
    compiled op called from the MLP, not a leaf layer; it is linear work, not "other". With
    a wide MLP it takes more time than every leaf product together, so the linear part must
    exceed it. (The CPU taken as one without AMX: with AMX the prompts' products, and 8-row
    decode steps', would stay on oneDNN and the gated kernel would never run.)"""
    from services.kernels import ops
    from services.worker.model.fused_ops import FusedSiluMLP

    monkeypatch.setattr(ops, "cpu_flag", lambda name, real=ops.cpu_flag: name != "amx_bf16" and real(name))
    llm = _wide_llm(tmp_path, hidden_size=256, num_hidden_layers=1, num_attention_heads=4)
    runner = llm.runner
    mlps = [m for m in runner.model.modules() if isinstance(m, FusedSiluMLP)]
    assert mlps and all(m._gated is not None for m in mlps)
    gated_s = [0.0]

    def timed(kernel):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()  # wall clock, as the profile's: the process's CPU time
            try:                       # also counts other threads (a full run's leftovers)
                return kernel(*args)
            finally:
                gated_s[0] += time.perf_counter() - t0
        return call

    for m in mlps:
        m._gated = timed(m._gated)
    params = GenerationParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [list(range(300 + 250 * i, 500 + 250 * i)) for i in range(8)]
    out = profile_shares(lambda: llm.generate(prompts, params), runner.model, runner.sampler, runner.lean,
                         runner.attn_backend)
    parts = out["parts_s"]
    assert gated_s[0] > 0 and parts["linear"] > gated_s[0]
    assert abs(sum(out["shares_of_body"].values()) - 1.0) < 0.01


def test_attention_share_times_the_backend_inside_the_forward() -> None:
    """``bench_offline --attention-share``: one backend call per layer and step, attention a
    part of the forward (never more), and the wrappers gone afterwards."""
    from benchmarks.engine.bench_offline import _with_attention_share

    torch.set_num_threads(1)
    llm = LLM(model=str(cached_tiny_model("llama")), dtype="float32", kv_cache_memory=1 << 22, num_threads=1)
    params = GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [list(range(300 + 50 * i, 340 + 50 * i)) for i in range(3)]
    steps = []
    inner = llm.runner.execute

    def counting(plan):  # type: ignore[no-untyped-def]
        steps.append(plan)
        return inner(plan)

    llm.runner.execute = counting  # type: ignore[method-assign]

    def go():  # type: ignore[no-untyped-def]
        from benchmarks.engine.bench_offline import Run

        produced = sum(len(o.token_ids) for o in llm.generate(prompts, params, decode=False))
        assert produced == 24
        return Run("ferry", "float32", 1, 1.0, 1.0, produced, 144, 24.0, 144.0, {})

    run = _with_attention_share(llm, go)
    share = run.profile
    layers = llm.runner.model.config.num_hidden_layers
    assert share is not None and share["attention_calls"] == layers * len(steps) > 0
    assert 0 < share["attention_s"] < share["forward_s"]
    assert 0 < share["attention_share_of_forward"] < 1
    assert "forward" not in vars(llm.runner.attn_backend) and llm.runner.execute is counting


class _TimedDecodeLayers:
    """The lean forward's kernels with decode_layers' process time summed and the part clocks it
    was given kept."""

    def __init__(self, kernels: object) -> None:
        self._kernels, self.cpu_s, self.times = kernels, 0.0, None

    def __getattr__(self, name: str) -> object:
        return getattr(self._kernels, name)

    def decode_layers(self, *args):  # type: ignore[no-untyped-def]
        self.times = args[-1]
        t0 = time.process_time()
        try:
            return self._kernels.decode_layers(*args)
        finally:
            self.cpu_s += time.process_time() - t0


def _one_call_llm(tmp_path: Path) -> LLM:
    llm = _wide_llm(tmp_path, hidden_size=512, num_hidden_layers=2, num_attention_heads=8)
    lean = llm.runner.lean
    assert lean is not None and lean.decode_args is not None
    lean.kernels = _TimedDecodeLayers(lean.kernels)
    return llm


def test_the_one_call_decode_steps_are_split_into_their_parts(tmp_path: Path) -> None:
    """A decode step's layers in one C++ call are one op to cProfile: without the call's own
    part clocks all of it would be "other"; with them each part has its share of the call."""
    llm = _one_call_llm(tmp_path)
    runner = llm.runner
    params = GenerationParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [list(range(300 + 40 * i, 316 + 40 * i)) for i in range(4)]
    out = profile_shares(lambda: llm.generate(prompts, params), runner.model, runner.sampler, runner.lean,
                         runner.attn_backend)
    timed = runner.lean.kernels
    parts = out["parts_s"]
    assert timed.times is not None and runner.lean.part_times is None  # the clocks were on, and are off again
    one_call = timed.times[1].tolist()  # process CPU seconds per part, as cProfile's clock
    # with AMX products from one row every decode step's q/k/v applies RoPE in its epilogue
    rope_in_products = runner.lean.decode_args.rows == 0 and bool(timed.amx_rope(-1))
    for name, seconds in zip(("rmsnorm", "linear", "rope", "attention"), one_call, strict=True):
        assert seconds == 0 if rope_in_products and name == "rope" else seconds > 0, name
    assert 0.8 * timed.cpu_s <= sum(one_call) <= timed.cpu_s  # the parts hold nearly all of the call
    for name, seconds in zip(("rmsnorm", "linear", "rope", "attention"), one_call, strict=True):
        assert parts[name] >= seconds  # counted in its part, beside the loop steps' own
    assert parts["other"] < out["body_s"] - sum(one_call)
    assert abs(sum(out["shares_of_body"].values()) - 1.0) < 0.01


def test_attention_share_counts_the_one_call_decode_steps(tmp_path: Path) -> None:
    from benchmarks.engine.bench_offline import Run, _with_attention_share

    llm = _one_call_llm(tmp_path)
    params = GenerationParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [list(range(300 + 40 * i, 316 + 40 * i)) for i in range(4)]

    def go() -> Run:
        produced = sum(len(o.token_ids) for o in llm.generate(prompts, params, decode=False))
        return Run("ferry", "bfloat16", 1, 1.0, 1.0, produced, 64, 64.0, 64.0, {})

    run = _with_attention_share(llm, go)
    timed = llm.runner.lean.kernels
    assert timed.times is not None and llm.runner.lean.part_times is None
    one_call_attention = float(timed.times[0, 3])
    assert one_call_attention > 0
    assert run.profile is not None and run.profile["attention_s"] > one_call_attention
    assert run.profile["attention_s"] < run.profile["forward_s"]
