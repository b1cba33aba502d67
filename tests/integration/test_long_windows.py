"""Sliding windows at full context: a Gemma-3-shaped model (local windows of 512 keys, every sixth
layer global) served token-exact with transformers at 6k-token prompts, where five layers in six
see less than a tenth of the context (backends/variant.py), and the KV cache the sequence holds
is the hybrid arithmetic's within 10 %: the global layer keeps all 6,006 tokens, each windowed
layer its last 512 (scheduler/ledger.py's HybridLedger releases the blocks behind the window)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.offline import LLM, GenerationParams
from services.scheduler.ledger import RELEASED, HybridLedger
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.slow

WINDOW = 512
PROMPT = 6000
NEW = 6
LAYERS = ["sliding_attention"] * 5 + ["full_attention"]


def gemma3(folder: Path) -> Path:
    return build_tiny_model(folder, "llama", model_type="gemma3_text", num_hidden_layers=6, layer_types=LAYERS,
                            sliding_window=WINDOW, max_position_embeddings=8192, head_dim=16,
                            query_pre_attn_scalar=16, rope_local_base_freq=10000.0)


def test_gemma3_shaped_model_is_token_exact_at_6k_tokens(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    folder = gemma3(tmp_path / "gemma3")
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(300, 40000, (PROMPT,), generator=gen).tolist()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, PROMPT:].tolist()
        logits = model(torch.tensor([prompt + want])).logits[0]
    del model
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=64 << 20, num_threads=2,
              max_num_batched_tokens=1024)
    assert llm.runner.max_model_len == 8192  # the model's own length, not the window
    assert sorted(llm.runner.attn_backend.variant_layers) == [0, 1, 2, 3, 4]
    ledger = llm.scheduler.ledger
    assert isinstance(ledger, HybridLedger) and ledger.window == WINDOW
    held: list[tuple[int, int]] = []  # (global blocks, windowed blocks) the sequence held at its end
    free = ledger.free

    def record(req_id: str) -> int:
        table = ledger.windows.tables.get(req_id, [])
        held.append((len(ledger.block_tables.get(req_id, [])), sum(b != RELEASED for b in table)))
        return free(req_id)

    ledger.free = record  # type: ignore[method-assign]
    out = llm.generate([prompt], GenerationParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0))[0]
    ledger.check_invariants()
    assert ledger.windows.num_free_blocks == ledger.windows.num_total_blocks  # all given back
    full_blocks, window_blocks = held[-1]
    layer_blocks = full_blocks * 1 + window_blocks * 5
    arithmetic = ((PROMPT + NEW) * 1 + WINDOW * 5) / 16  # tokens kept per layer, in blocks of 16
    assert abs(layer_blocks - arithmetic) <= 0.10 * arithmetic, (full_blocks, window_blocks, arithmetic)
    assert layer_blocks < 0.3 * (PROMPT + NEW) * 6 / 16  # against every layer keeping every block
    assert out.token_ids == want
    logp = torch.log_softmax(logits.float(), -1)
    assert out.logprobs is not None
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert abs(lp.sampled.logprob - float(logp[PROMPT - 1 + j, tok])) <= 1e-3, j


def test_a_windowed_model_served_by_ferry_serve_uses_the_hybrid_cache(tmp_path: Path) -> None:
    """The same through real processes: the worker reports its windowed pool in WorkerReady, the
    scheduler service builds its hybrid ledger from it, and token-id prompts far past the window
    come back as transformers' greedy tokens, several at once and twice over (released blocks
    reused)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from transformers import AutoTokenizer

    from tests.integration.conftest import ServeProcess
    from tests.integration.test_offline_tiny import hf_greedy

    folder = build_tiny_model(tmp_path / "mistral", "llama", model_type="mistral", sliding_window=24)
    serve = ServeProcess(folder, tmp_path, ["--block-size", "16", "--max-num-batched-tokens", "32"]).start()
    try:
        serve.wait_ready()
        assert "windowed layers:" in serve.log()  # the scheduler's hybrid ledger
        prompts = [list(range(300 + 40 * i, 380 + 40 * i)) for i in range(4)]
        tok = AutoTokenizer.from_pretrained(folder)
        want = [tok.decode(ids) for ids in hf_greedy(folder, prompts, 12)]

        def complete(prompt: list[int]) -> str:
            r = httpx.post(f"{serve.base_url}/v1/completions", trust_env=False, timeout=120, json={
                "model": str(folder), "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        with ThreadPoolExecutor(4) as pool:
            for _ in range(2):  # together, twice: windowed blocks released and handed on
                assert list(pool.map(complete, prompts)) == want
    finally:
        serve.kill()
