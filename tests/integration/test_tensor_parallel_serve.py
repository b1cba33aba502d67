"""``ferry serve --tensor-parallel-size 2`` on the tiny model: real processes, real sockets.

- greedy output through the HTTP API equals the unsplit model's (the offline
  engine at TP=1 on the same token ids), token for token, in float32;
- the engine reports twice the KV blocks one unsplit rank would have (each rank
  holds half the KV heads in the same byte budget);
- SIGKILL of rank 1 mid-stream: the supervisor restarts both ranks (a fresh
  rendezvous), the scheduler recomputes, and the stream finishes with exactly
  the tokens it would have produced uninterrupted, under the default poison rule
  (the group restart is one crash of the stream, not two).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from services.engine.offline import LLM, GenerationParams
from services.worker.model.tensor_parallel import rank_config
from shared.capacity import num_kv_blocks
from tests.integration.conftest import TINY_KV_BYTES, ServeProcess, tail, wait_for

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 2759, 8842, 30, 359, 3135, 282, 253, 1798, 28, 2491, 11, 2023]
MAX_TOKENS = 300  # long enough that the kill lands mid-stream


@pytest.fixture(scope="module")
def serve(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    # the default poison rule (max_request_crashes 2): the rank kill below restarts the whole group,
    # which must count as one crash of the stream it interrupts, not one per rank
    proc = ServeProcess(tiny_model_dir, tmp_path_factory.mktemp("tp"), ["--tensor-parallel-size", "2"]).start()
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[int]:
    """The unsplit model's greedy tokens for PROMPT (offline engine, TP=1, float32)."""
    with LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=TINY_KV_BYTES, num_threads=1) as llm:
        out = llm.generate([PROMPT], GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return out[0].token_ids


def body(model: Path, stream: bool) -> dict[str, object]:
    return {"model": str(model), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, "logprobs": 1}


def tokens_of(resp_json: dict) -> list[str]:  # type: ignore[type-arg]
    return list(resp_json["choices"][0]["logprobs"]["tokens"])


def test_two_ranks_and_twice_the_kv_blocks(serve: ServeProcess, tiny_model_dir: Path) -> None:
    assert len(serve.children("worker")) == 2
    health = httpx.get(f"{serve.base_url}/health", trust_env=False, timeout=5).json()
    assert health["scheduler"]["num_workers"] == 2
    config = json.loads((tiny_model_dir / "config.json").read_text())
    whole = num_kv_blocks(TINY_KV_BYTES, config, "float32", 16)
    per_rank = num_kv_blocks(TINY_KV_BYTES, rank_config(config, 2), "float32", 16)
    assert per_rank == 2 * whole
    rows = health["engines"]
    wait_for(lambda: httpx.get(f"{serve.base_url}/health", trust_env=False, timeout=5).json()["engines"][0]
             ["num_kv_blocks_total"] is not None, 10, what="engine stats")
    rows = httpx.get(f"{serve.base_url}/health", trust_env=False, timeout=5).json()["engines"]
    assert rows[0]["num_kv_blocks_total"] == per_rank


def test_greedy_through_the_api_equals_the_unsplit_model(serve: ServeProcess, tiny_model_dir: Path,
                                                          reference: list[int]) -> None:
    r = httpx.post(f"{serve.base_url}/v1/completions", json=body(tiny_model_dir, False), timeout=120,
                   trust_env=False)
    assert r.status_code == 200, r.text
    text_tokens = tokens_of(r.json())
    assert len(text_tokens) == MAX_TOKENS
    detok = httpx.post(f"{serve.base_url}/detokenize", json={"tokens": reference}, timeout=10, trust_env=False)
    assert "".join(text_tokens) == detok.json()["prompt"]


def rank_process(serve: ServeProcess, rank: int) -> psutil.Process:
    found = [p for p in serve.children("worker") if "--rank" in p.cmdline()
             and p.cmdline()[p.cmdline().index("--rank") + 1] == str(rank)]
    assert len(found) == 1, found
    return found[0]


def test_killing_one_rank_mid_stream_recovers_with_the_same_tokens(serve: ServeProcess, tiny_model_dir: Path,
                                                                    reference: list[int]) -> None:
    before = serve.metrics().get("ferry:worker_restarts_total", 0.0)
    victim = rank_process(serve, 1)
    pieces: list[str] = []
    events: list[dict] = []  # type: ignore[type-arg]
    started = threading.Event()

    def read() -> None:
        with httpx.stream("POST", f"{serve.base_url}/v1/completions", json=body(tiny_model_dir, True),
                          timeout=300, trust_env=False) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    events.append(event)
                    choice = (event.get("choices") or [{}])[0]
                    pieces.extend((choice.get("logprobs") or {}).get("tokens") or [])
                    if len(pieces) >= 10:
                        started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(120), "the stream did not start"
    os.kill(victim.pid, signal.SIGKILL)
    at_kill = len(pieces)
    reader.join(timeout=300)
    assert at_kill < MAX_TOKENS, "the stream had already finished when the rank died"
    assert not reader.is_alive()
    assert not any("error" in e for e in events), [e for e in events if "error" in e]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    detok = httpx.post(f"{serve.base_url}/detokenize", json={"tokens": reference}, timeout=10, trust_env=False)
    assert "".join(pieces) == detok.json()["prompt"]  # the same tokens as without the kill
    wait_for(lambda: len(serve.children("worker")) == 2 and victim.pid not in
             [p.pid for p in serve.children("worker")], 60, what="both ranks back")
    wait_for(lambda: serve.metrics().get("ferry:worker_restarts_total", 0.0) > before, 30, what="restart counted")
    # the whole log: the streams finishing after the restart push these lines out of log()'s tail
    whole = tail(serve.log_path, 1 << 30)
    assert "restarting worker0" in whole and "restarting worker1" in whole
    # the scheduler took rank 0 down with rank 1 (one outage, one crash for the poison rule)
    assert "goes down with its tensor-parallel group" in whole
