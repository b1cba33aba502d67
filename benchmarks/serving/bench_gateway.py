"""``python -m benchmarks.serving.bench_gateway``: what the gateway itself costs per streamed token.

Starts a real gateway process (``python -m services.gateway``, the default
model's tokenizer) in front of ``FakeScheduler``, which produces one token per
request every ``--tick-ms``, so nearly all the work measured is the gateway's:
HTTP, validation, tokenization, the zmq client, detokenization, stop-string
checks and SSE encoding. N concurrent streaming completions run at once; the
gateway process's CPU time (user + system, from /proc) over the run divided by
the tokens streamed is the headline, because wall time on a shared machine
mostly measures the neighbours. The streams are read by the load tests' own client
(``loadtests/client.py``), whose CPU per token is reported beside the gateway's: on a
machine where the load generator shares the cores with the server, it is part of what a
benchmark measures. Prints one JSON object; ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import uvloop

from benchmarks.serving.fake_scheduler import FakeScheduler
from loadtests.client import ClientConfig, send_request, stream_session
from loadtests.trace import TraceRequest
from services.gateway.text.tokenizer import load_gateway_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé, 日本語 and emoji 🎉 keep the detokenizer honest.\n"
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the gateway did not become ready")


async def run_load(url: str, model: str, gateway_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """The streams through the load tests' own client (loadtests/client.py), timed on both sides."""
    config = ClientConfig(base_url=url, model=model, request_timeout_s=120,
                          extra_body={"stop": args.stop} if args.stop else {})
    requests = [TraceRequest(id=f"r{i}", prompt=f"request {i}: tell me a story", max_tokens=args.max_tokens)
                for i in range(args.streams)]
    async with stream_session(120.0) as client:
        warm = TraceRequest(id="warm", prompt="warm-up", max_tokens=8)
        await send_request(client, warm, config, time.perf_counter())
        proc = psutil.Process(gateway_pid)
        cpu0 = proc.cpu_times()
        client0 = time.thread_time()  # this thread runs the client; the fake scheduler has its own
        t0 = time.perf_counter()
        records = await asyncio.gather(*(send_request(client, r, config, t0) for r in requests))
        wall = time.perf_counter() - t0
        client_cpu = time.thread_time() - client0
        cpu1 = proc.cpu_times()
    failed = [r for r in records if r.status != "ok"]
    if failed:
        raise RuntimeError(f"{len(failed)} streams failed, first: {failed[0].error}")
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    chunks = sum(r.output_tokens for r in records)
    ttfts = sorted(r.ttft_s or 0.0 for r in records)
    return {
        "streams": args.streams, "max_tokens": args.max_tokens, "stop_strings": len(args.stop),
        "tick_ms": args.tick_ms, "chunks": chunks, "wall_s": round(wall, 3),
        "chunks_per_s_wall": round(chunks / wall), "gateway_cpu_s": round(cpu, 3),
        "gateway_cpu_us_per_token": round(cpu / max(chunks, 1) * 1e6, 1),
        "client_cpu_s": round(client_cpu, 3),
        "client_cpu_us_per_token": round(client_cpu / max(chunks, 1) * 1e6, 1),
        "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1000, 1),
        "ttft_max_ms": round(ttfts[-1] * 1000, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.bench_gateway", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer the gateway loads")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--tick-ms", type=float, default=2.0, help="the fake scheduler's step time")
    parser.add_argument("--stop", action="append", default=[], help="stop strings that never match (cost)")
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args(argv)

    tok = load_gateway_tokenizer(args.model)
    script = tok.encode(TEXT * 4, add_special_tokens=False)
    runtime = tempfile.mkdtemp(prefix="ferry-gw-bench-")
    endpoint = f"ipc://{runtime}/gateway.sock"
    port = free_port()
    fake = FakeScheduler(endpoint, script, tick_s=args.tick_ms / 1000,
                         max_model_len=max(4096, args.max_tokens + 64))
    cmd = [sys.executable, "-m", "services.gateway", "--model", args.model, "--port", str(port),
           "--scheduler-endpoint", endpoint, "--log-level", "WARNING", "--max-n", "1"]
    gateway = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, gateway)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        result = uvloop.run(run_load(url, model, gateway.pid, args))
    finally:
        os.killpg(gateway.pid, signal.SIGTERM)
        try:
            gateway.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(gateway.pid, signal.SIGKILL)
        fake.close()
    print(json.dumps(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
