"""Two engines, two gateways, real processes: ``ferry serve --data-parallel-size 2`` on the tiny
random model, plus a second gateway that knows only engine 0 and finds engine 1 in Redis.

- a shared-prefix workload lands on one engine, whose prefix cache then hits;
- distinct prompts spread over both engines;
- SIGKILL of one engine's scheduler mid-load: every request is answered; those
  that were only queued there are re-routed and complete; those it was running
  are held and resumed on the restarted engine, and at worst (not back in time)
  end with 503 + Retry-After (retryable): never more than its running set.
  benchmarks/serving/engine_kill.py is the same run as a load test with a board.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import GatewayProcess, ServeProcess, wait_for

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 2


def by_engine(base_url: str, name: str, **match: str) -> dict[str, float]:
    """One metric's value per ``engine`` label (other labels must match ``match``)."""
    text = httpx.get(f"{base_url}/metrics", timeout=5.0, trust_env=False).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in match.items()):
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + float(s.value)
    return out


def engines(base_url: str) -> dict[str, dict[str, object]]:
    body = httpx.get(f"{base_url}/health", timeout=5.0, trust_env=False).json()
    return {str(e["name"]): e for e in body["engines"]}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("dp")
    serve = ServeProcess(tiny_model_dir, tmp, ["--data-parallel-size", "2", "--max-num-seqs", str(MAX_NUM_SEQS),
                                               "--registry-ttl-s", "2"]).start()
    second: GatewayProcess | None = None
    try:
        serve.wait_ready()
        engine0 = f"ipc://{serve.runtime_dir}/engine0/gateway.sock"
        redis_url = f"unix://{serve.runtime_dir}/redis.sock"
        second = GatewayProcess(str(tiny_model_dir), engine0, tmp, "--redis-url", redis_url).wait_ready()
        # the second gateway was told of engine 0 only: engine 1 joins from the registry
        wait_for(lambda: sum(bool(e["ready"]) for e in engines(second.base_url).values()) == 2, 30,
                 what="the second gateway discovers engine 1")
        yield serve, second
    finally:
        if second is not None:
            second.kill()
        serve.kill()


def test_both_gateways_see_both_engines(cluster) -> None:  # type: ignore[no-untyped-def]
    serve, second = cluster
    for base in (serve.base_url, second.base_url):
        rows = engines(base)
        assert set(rows) == {"0", "1"}, rows
        assert all(r["ready"] for r in rows.values())
    assert {r["source"] for r in engines(second.base_url).values()} == {"static", "registry"}


def test_a_shared_prefix_lands_on_one_engine_and_hits_its_cache(cluster, tiny_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    serve, second = cluster
    model = str(tiny_model_dir)
    shared = "The quick brown fox jumps over the lazy dog. " * 12  # well past the 4 routed blocks
    before = {b: by_engine(b, "ferry:requests_routed_total", outcome="routed")
              for b in (serve.base_url, second.base_url)}
    hits_before = by_engine(serve.base_url, "ferry:prefix_cache_hits_total")
    for i in range(8):
        base = (serve.base_url, second.base_url)[i % 2]
        body = {"model": model, "prompt": shared + f"Question {i}?", "max_tokens": 4, "temperature": 0.0}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120, trust_env=False)
        assert r.status_code == 200, r.text
    used: set[str] = set()
    for b in (serve.base_url, second.base_url):
        after = by_engine(b, "ferry:requests_routed_total", outcome="routed")
        used |= {e for e, v in after.items() if v > before[b].get(e, 0.0)}
    assert len(used) == 1, used  # both gateways chose the same engine
    engine = used.pop()
    want = 7 * 4 * 16  # 7 followers x at least 4 blocks

    def gained() -> float:
        return by_engine(serve.base_url, "ferry:prefix_cache_hits_total").get(engine, 0.0) - hits_before.get(engine, 0.0)

    # EngineStats reach the gateway every stats_interval_s: wait for the one that carries the hits
    # (a fixed one-second sleep was a guess on a busy machine)
    wait_for(lambda: gained() >= want, 15, what=f"{want} prefix-cache hits on engine {engine} in the gateway's metrics")


def test_distinct_prompts_spread_over_both_engines(cluster, tiny_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    serve, second = cluster
    before = by_engine(serve.base_url, "ferry:requests_routed_total", outcome="routed")
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    prompts = [f"{w} {v} number {i}" for i, (w, v) in enumerate(zip(words * 2, reversed(words * 2), strict=True))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        bodies = [{"model": str(tiny_model_dir), "prompt": p, "max_tokens": 4, "temperature": 0.0} for p in prompts]
        results = list(pool.map(lambda b: httpx.post(f"{serve.base_url}/v1/completions", json=b, timeout=120,
                                                     trust_env=False), bodies))
    assert all(r.status_code == 200 for r in results)
    after = by_engine(serve.base_url, "ferry:requests_routed_total", outcome="routed")
    spread = {e: after[e] - before.get(e, 0.0) for e in after}
    assert sum(spread.values()) == 20
    assert min(spread.values()) >= 5, spread  # neither engine is left out


def engine_scheduler(serve: ServeProcess, engine: int) -> psutil.Process:
    folder = f"{serve.runtime_dir}/engine{engine}/"
    found = [p for p in serve.children("scheduler") if folder in " ".join(p.cmdline())]
    assert len(found) == 1, found
    return found[0]


def test_sigkill_of_an_engine_loses_only_what_it_was_running(cluster, tiny_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    serve, second = cluster
    rerouted_before = sum(by_engine(b, "ferry:requests_routed_total", outcome="rerouted").get("0", 0.0)
                          for b in (serve.base_url, second.base_url))
    body = {"model": str(tiny_model_dir), "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}

    def one(i: int) -> httpx.Response:
        base = (serve.base_url, second.base_url)[i % 2]
        return httpx.post(f"{base}/v1/completions", json={**body, "prompt": f"request {i} " * (1 + i % 3)},
                          timeout=180, trust_env=False)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        # engine 1 runs MAX_NUM_SEQS and holds the rest in its queue: kill it then
        wait_for(lambda: (engines(serve.base_url)["1"].get("num_waiting") or 0) >= 2, 60,
                 interval_s=0.05, what="a queue on engine 1")
        victim = engine_scheduler(serve, 1)
        os.kill(victim.pid, signal.SIGKILL)
        results = [f.result(timeout=180) for f in futures]
    ok = [r for r in results if r.status_code == 200]
    failed = [r for r in results if r.status_code != 200]
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 200
    for r in failed:
        assert r.status_code == 503, r.text
        assert r.headers.get("retry-after"), r.headers
        assert r.json()["error"]["code"] == "scheduler_unavailable"
    # only the requests engine 1 was running are lost (at most its running set)
    assert len(failed) <= MAX_NUM_SEQS, [r.text for r in failed]
    rerouted = sum(by_engine(b, "ferry:requests_routed_total", outcome="rerouted").get("0", 0.0)
                   for b in (serve.base_url, second.base_url))
    assert rerouted - rerouted_before >= 2  # the queued ones moved to engine 0
    # the supervisor restarts engine 1 and both gateways route to it again, no gateway restart
    wait_for(lambda: all(all(e["ready"] for e in engines(b).values()) for b in (serve.base_url, second.base_url)),
             120, what="engine 1 back in both gateways")
    r = httpx.post(f"{second.base_url}/v1/completions", json={**body, "prompt": "after", "max_tokens": 4},
                   timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
