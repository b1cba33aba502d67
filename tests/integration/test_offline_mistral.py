"""Mistral-style models (a sliding window on every layer) run exactly past their window: each
query sees its last ``window`` keys (backends/variant.py), at any length up to the model's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.offline import LLM, GenerationParams
from tests.integration.test_offline_tiny import hf_greedy
from tests.tiny_models import build_tiny_model

WINDOW = 24


def test_sliding_window_model_matches_transformers_past_its_window(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    folder = build_tiny_model(tmp_path / "mistral", "llama", model_type="mistral", sliding_window=WINDOW)
    # block size 4: a window of 24 keys starts inside a block as often as not; chunks of 8
    # tokens: prompt chunks with a cached prefix, some of it outside their window
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=8 << 20, block_size=4, num_threads=1,
              max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert llm.runner.max_model_len > 4 * WINDOW  # no cap at the window any more
    prompts = [list(range(300, 330)), [7, 8, 9], list(range(1000, 1023)), list(range(2000, 2060))]
    outs = llm.generate(prompts, GenerationParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(folder, prompts, 16)
    assert all(len(o.token_ids) == 16 for o in outs)


def test_a_tight_window_pool_reuses_released_blocks_and_stays_exact(tmp_path: Path) -> None:
    """Every layer windowed: the whole KV budget is the windowed pool (a hybrid cache), 32 blocks
    of 4 here. Eight 60-80 token sequences need ~20 blocks each over their lives, so blocks
    released behind one sequence's window are handed to another while the first still runs:
    a read of a released block would change its answer."""
    from services.scheduler.ledger import HybridLedger

    torch.set_num_threads(1)
    folder = build_tiny_model(tmp_path / "mistral", "llama", model_type="mistral", sliding_window=WINDOW)
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=64 << 10, block_size=4, num_threads=1,
              max_num_batched_tokens=16, long_prefill_token_threshold=8, max_num_seqs=4)
    ledger = llm.scheduler.ledger
    assert isinstance(ledger, HybridLedger) and ledger.windows.num_total_blocks == 32
    handed: list[int] = []
    allocate = ledger.windows.allocate

    def count(req_id: str, num_tokens: int) -> list[int] | None:
        ids = allocate(req_id, num_tokens)
        handed.extend(ids or [])
        return ids

    ledger.windows.allocate = count  # type: ignore[method-assign]
    prompts = [list(range(100 + 50 * i, 160 + 50 * i + 2 * i)) for i in range(8)]
    outs = llm.generate(prompts, GenerationParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_greedy(folder, prompts, 16)
    assert len(handed) > 3 * ledger.windows.num_total_blocks  # each block handed out several times
    ledger.check_invariants()
    assert ledger.windows.num_free_blocks == 32


def test_a_budget_below_one_window_and_one_step_is_refused_at_its_edge(tmp_path: Path) -> None:
    """A request whose window and chunk did not fit the windowed pool would wait forever: the
    worker refuses such a budget by name. Window 24 in blocks of 4 (7 blocks) plus a 16-token
    step (4 blocks): 11 blocks of 2 layers x 1 KiB, 22,528 bytes, and one byte less."""
    folder = build_tiny_model(tmp_path / "mistral", "llama", model_type="mistral", sliding_window=WINDOW)
    kwargs = dict(model=str(folder), dtype="float32", block_size=4, num_threads=1, max_num_batched_tokens=16)
    llm = LLM(kv_cache_memory=22_528, **kwargs)  # type: ignore[arg-type]
    assert llm.runner.hybrid_kv is not None and llm.runner.hybrid_kv.num_window_blocks == 11
    with pytest.raises(ValueError, match="too small for this model's hybrid KV cache.*need 11 blocks.*get 10"):
        LLM(kv_cache_memory=22_527, **kwargs)  # type: ignore[arg-type]
