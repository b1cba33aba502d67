"""``ferry serve --data-parallel-size 2 --tensor-parallel-size 2``: two engines, each split over two
ranks (four worker processes, two rendezvous), on the tiny random-weight model in float32.

Every greedy completion through the HTTP API equals what the unsplit model gives on one
engine (the offline engine at TP=1, DP=1, same token ids), token for token, and both
engines received requests.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.engine.offline import LLM, GenerationParams
from tests.integration.conftest import TINY_KV_BYTES, ServeProcess
from tests.integration.test_data_parallel import by_engine, engines

pytestmark = pytest.mark.slow

BASE = [504, 2759, 8842, 30, 359, 3135, 282, 253, 1798, 28, 2491, 11, 2023, 30, 359, 3135, 282, 253]
# distinct first blocks (16 tokens), so prefix affinity does not send them all to one engine
PROMPTS = [[1, 100 + 37 * i, *BASE[i % 5:], *BASE[: i % 5]] for i in range(8)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def serve(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(tiny_model_dir, tmp_path_factory.mktemp("dptp"),
                        ["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--max-num-seqs", "2"]).start()
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[list[int]]:
    """The unsplit model's greedy tokens for each prompt (offline engine, one engine, TP=1, float32)."""
    with LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=TINY_KV_BYTES, num_threads=1) as llm:
        out = llm.generate(PROMPTS, GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in out]


def test_four_ranks_in_two_engines(serve: ServeProcess) -> None:
    assert len(serve.children("worker")) == 4
    assert len(serve.children("scheduler")) == 2
    rows = engines(serve.base_url)
    assert set(rows) == {"0", "1"} and all(r["ready"] for r in rows.values()), rows


def test_greedy_equals_one_unsplit_engine_and_both_engines_serve(serve: ServeProcess, tiny_model_dir: Path,
                                                                reference: list[list[int]]) -> None:
    before = by_engine(serve.base_url, "ferry:requests_routed_total", outcome="routed")

    def complete(prompt: list[int]) -> httpx.Response:
        body = {"model": str(tiny_model_dir), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 1}
        return httpx.post(f"{serve.base_url}/v1/completions", json=body, timeout=180, trust_env=False)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(complete, PROMPTS))
    for prompt, expected, r in zip(PROMPTS, reference, results, strict=True):
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == MAX_TOKENS == len(expected)
        detok = httpx.post(f"{serve.base_url}/detokenize", json={"tokens": expected}, timeout=10, trust_env=False)
        assert "".join(tokens) == detok.json()["prompt"], prompt
    after = by_engine(serve.base_url, "ferry:requests_routed_total", outcome="routed")
    spread = {e: after[e] - before.get(e, 0.0) for e in after}
    assert sum(spread.values()) == len(PROMPTS)
    assert spread["0"] >= 1 and spread["1"] >= 1, spread  # both split engines computed
