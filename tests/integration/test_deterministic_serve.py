"""``ferry serve --deterministic`` on the real default model in bfloat16, as a user sees it.

The report behind issue 56: the same seeded chat (temperature 1) sent three times came back
different once its prompt hit the prefix cache, and streamed and plain sends differed. Here
seeded non-ASCII chats are sent plain, streamed, repeated (prefix-cache hits), inside a
burst of other requests of other lengths, and once more after the worker was killed and
restarted: text, token logprobs and top logprobs must be the same every time. The KV budget is
small enough that the burst preempts, and the worker is killed while the seeded chats stream:
both recompute a request's tokens so far as a prompt, through other kernels than the decodes
that first computed them, which without the flag moves their logprobs (this test fails
without ``--deterministic``; checked when it was written).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.integration.conftest import ServeProcess, read_metrics, wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CHATS = [
    "Escreva um poema curto sobre o mar e a saudade, com acentuação: ção, ã, é.",
    "日本の秋について短い文章を書いてください。🍁",
    "Пожалуйста, опиши зимний вечер в деревне. ❄️ Ü ß ø",
]
OTHERS = ["Tell me a long story about a lighthouse keeper.", "Count from one to twenty in French.",
          "Why is the sky blue? Explain it to a child.", "List five fruits.", "Écris une lettre à un ami."]


@pytest.fixture(scope="module")
def det(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    serve = ServeProcess(MODEL, tmp_path_factory.mktemp("det"), [
        "--dtype", "bfloat16", "--deterministic", "--kv-cache-memory", str(20 << 20)]).start()
    try:
        serve.wait_ready(timeout_s=600)  # the first run converts the GGUF (cached afterwards)
        yield serve
    finally:
        serve.kill()


def _body(i: int, stream: bool, max_tokens: int = 32) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": CHATS[i]}], "max_tokens": max_tokens,
            "temperature": 1.0, "top_p": 0.95, "seed": 1000 + i, "logprobs": True, "top_logprobs": 3,
            "stream": stream}


def _lp(entries: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["token"], e["logprob"], tuple((t["token"], t["logprob"]) for t in e["top_logprobs"])) for e in entries]


def plain(url: str, i: int, max_tokens: int = 32) -> tuple[str, list[tuple[Any, ...]]]:
    resp = httpx.post(f"{url}/v1/chat/completions", json=_body(i, False, max_tokens), timeout=300, trust_env=False)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["message"]["content"], _lp(choice["logprobs"]["content"])


def streamed(url: str, i: int, max_tokens: int = 32, started: threading.Event | None = None,
             ) -> tuple[str, list[tuple[Any, ...]]]:
    text, entries = "", []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=_body(i, True, max_tokens), timeout=300,
                      trust_env=False) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if started is not None and text:
                started.set()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
                entries += (choice.get("logprobs") or {}).get("content") or []
    return text, _lp(entries)


def other(url: str, k: int) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": OTHERS[k % len(OTHERS)]}],
            "max_tokens": 48 + 16 * k, "temperature": 0.8, "ignore_eos": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300, trust_env=False).status_code


def test_seeded_chats_are_the_same_bits_plain_streamed_repeated_in_bursts_and_after_a_restart(
        det: ServeProcess) -> None:
    url = det.base_url
    first = [plain(url, i) for i in range(len(CHATS))]
    for text, lps in first:
        assert text and len(lps) == 32 and all(len(top) == 3 for _, _, top in lps)
    hits_before = read_metrics(url).get("ferry:prefix_cache_hits_total", 0.0)
    for i in range(len(CHATS)):
        assert streamed(url, i) == first[i], f"chat {i}: streamed differs from plain"
        assert plain(url, i) == first[i], f"chat {i}: a repeat (its prompt in the prefix cache) differs"
    wait_for(lambda: read_metrics(url).get("ferry:prefix_cache_hits_total", 0.0) > hits_before, 15,
             what="prefix-cache hits of the repeats")
    with ThreadPoolExecutor(max_workers=12) as pool:  # a burst: the seeded chats beside others, chunked
        noise = [pool.submit(other, url, k) for k in range(8)]
        mine = [pool.submit(streamed if i % 2 else plain, url, i) for i in range(len(CHATS))]
        more = [pool.submit(other, url, k) for k in range(8, 12)]
        assert [f.result() for f in mine] == first, "a seeded chat inside a burst differs"
        assert all(f.result() == 200 for f in noise + more)
    wait_for(lambda: read_metrics(url).get("ferry:num_preemptions_total", 0.0) > 0, 15,
             what="preemptions in the burst (the KV budget is meant to be short)")
    # the worker killed while the seeded chats stream: each resumes by recomputing what it has
    long = [plain(url, i, 96) for i in range(len(CHATS))]
    started = threading.Event()
    old = det.pid("worker")
    with ThreadPoolExecutor(max_workers=len(CHATS)) as pool:
        resumed = [pool.submit(streamed, url, i, 96, started) for i in range(len(CHATS))]
        assert started.wait(120), "no token arrived"
        os.kill(old, signal.SIGKILL)
        assert [f.result(timeout=300) for f in resumed] == long, "a seeded chat resumed after a worker restart"
    assert det.pid("worker") != old
    assert [plain(url, i) for i in range(len(CHATS))] == first, "after the restart"
