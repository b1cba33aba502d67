"""Mistral-style models (a sliding window on every layer) run exactly: the runner caps
max_model_len at the window, inside which windowed attention is plain causal attention."""

from __future__ import annotations

from pathlib import Path

import torch

from services.engine.offline import LLM, GenerationParams
from tests.integration.test_offline_tiny import hf_greedy
from tests.tiny_models import build_tiny_model

WINDOW = 48


def test_sliding_window_model_matches_transformers(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    folder = build_tiny_model(tmp_path / "mistral", "llama", model_type="mistral", sliding_window=WINDOW)
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=8 << 20, block_size=4, num_threads=1,
              max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert llm.runner.max_model_len == WINDOW
    prompts = [list(range(300, 330)), [7, 8, 9]]
    outs = llm.generate(prompts, GenerationParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(folder, prompts, 12)
    too_long = llm.generate([list(range(100, 140))], GenerationParams(max_tokens=12, temperature=0.0))
    assert too_long[0].finish_reason == "too_long"
