"""``bench_offline --profile``'s split of the forward (services/engine/bench_profile.py) on the
tiny model: through the lean forward and through transformers' own, the body is found, the
parts are positive where they must be, and they add up to the body."""

from __future__ import annotations

import pytest
import torch

from services.engine.bench_profile import profile_shares
from services.engine.offline import LLM, GenerationParams
from tests.conftest import cached_tiny_model


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
