"""The sharp edges a new operator hit, on one real ``ferry serve`` of the tiny model.

A KV cache smaller than the model's context (max_model_len capped at start-up), the
in-flight bound met exactly by closed-loop streaming clients, typed /v1/config with
the workers' resolved numbers, the key rules on the API endpoints, the refusal
metric for a bad content type, logs that are JSON lines only, and a runtime folder
left without sockets.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from services.gateway.admission import keys_cli
from tests.integration.conftest import ServeProcess, read_metrics, tail

pytestmark = pytest.mark.slow  # starts a cluster
KV_BYTES = 256 << 10  # the tiny model needs 512 B per token: 512 tokens, half its 1024 context
CHAT = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}


def stream_chat(client: httpx.Client, base: str) -> int:
    with client.stream("POST", f"{base}/v1/chat/completions", json={**CHAT, "max_tokens": 4, "stream": True}) as r:
        for _ in r.iter_lines():
            pass
        return r.status_code


def test_operator_edges(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    serve = ServeProcess(tiny_model_dir, tmp_path, [
        "--kv-cache-memory", str(KV_BYTES), "--max-inflight-requests", "2",
        "--served-model-name", "smollm2-135m-instruct"]).start()
    try:
        serve.wait_ready()
        base = serve.base_url
        with httpx.Client(timeout=120.0, trust_env=False) as client:
            # 1. max_model_len decided at start-up: what the KV cache holds, reported everywhere
            cfg = client.get(f"{base}/v1/config").json()
            [worker] = cfg["workers"]
            capacity = worker["num_kv_blocks"] * worker["block_size"]
            assert capacity < 1024
            assert cfg["max_model_len"] == cfg["scheduler"]["max_model_len"] == capacity
            assert client.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == capacity
            no_max_tokens = client.post(f"{base}/v1/chat/completions", json=CHAT)
            assert no_max_tokens.status_code == 200, no_max_tokens.text

            # 2. /v1/config is typed, with the worker's resolved numbers
            assert cfg["scheduler"]["max_num_seqs"] == 128 and cfg["scheduler"]["enable_prefix_caching"] is True
            assert cfg["scheduler"]["queue_timeout_s"] == 60.0 and cfg["scheduler"]["num_kv_blocks"] == worker["num_kv_blocks"]
            assert worker["dtype"] == "float32" and worker["device"] == "cpu" and worker["num_threads"] == 1
            assert worker["rank"] == 0 and worker["kv_cache_bytes"] > 0 and worker["pid"] > 0

            # 3. two closed-loop streaming clients never meet the in-flight bound of 2
            with ThreadPoolExecutor(2) as pool:
                statuses = list(pool.map(lambda _: [stream_chat(client, base) for _ in range(7)], range(2)))
            assert [s for run in statuses for s in run] == [200] * 14

            # 4. a bad content type is a counted refusal
            bad = client.post(f"{base}/v1/chat/completions", content=json.dumps(CHAT),
                              headers={"content-type": "text/plain"})
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_content_type"
            assert read_metrics(base)["ferry:request_rejected_total"] == 1

            # 5. keys (added with --runtime-dir after the subcommand) cover the API endpoints
            assert keys_cli.main(["add", "op", "--runtime-dir", serve.runtime_dir]) == 0
            key = {"Authorization": f"Bearer {capsys.readouterr().out.strip()}"}
            assert client.get(f"{base}/v1/models").status_code == 401
            assert client.post(f"{base}/tokenize", json={"prompt": "hi"}).status_code == 401
            assert client.post(f"{base}/detokenize", json={"tokens": [1]}).status_code == 401
            assert client.get(f"{base}/v1/models", headers=key).status_code == 200
            assert client.post(f"{base}/tokenize", json={"prompt": "hi"}, headers=key).json()["count"] > 0
            health = client.get(f"{base}/health").json()  # no key needed
            assert health["redis"]["keys_cached"] == 1 and health["redis"]["auth"] == "redis"
        assert serve.stop() == 0
    finally:
        if serve.proc is not None and serve.proc.poll() is None:
            serve.kill()  # a failed check: kill the whole tree (this also removes the folder)
    # 6. the runtime folder the operator named stays, without sockets
    assert os.path.isdir(serve.runtime_dir) and not [n for n in os.listdir(serve.runtime_dir) if n.endswith(".sock")]
    os.rmdir(serve.runtime_dir)
    # 7. logs are JSON lines; stdout carries the banner; no progress bars, no raw Redis output
    log = tail(serve.log_path, 1 << 30)
    assert "\r" not in log and "Loading weights" not in log
    other = []
    for line in log.splitlines():
        if line.startswith("{"):
            json.loads(line)
        elif line and not line.startswith(("ferry is serving", "  ", "ferry serve:")):
            other.append(line)
    assert other == [], other
    assert '"service": "redis"' in log
