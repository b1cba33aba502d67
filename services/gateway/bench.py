"""``python -m services.gateway.bench``: what the gateway itself costs per streamed token.

Starts a real gateway process (``python -m services.gateway``, the default
model's tokenizer) in front of ``FakeScheduler``, which produces one token per
request every ``--tick-ms``, so nearly all the work measured is the gateway's:
HTTP, validation, tokenization, the zmq client, detokenization, stop-string
checks and SSE encoding. N concurrent streaming completions run at once; the
gateway process's CPU time (user + system, from /proc) over the run divided by
the tokens streamed is the headline, because wall time on a shared machine
mostly measures the neighbours. Prints one JSON object; ``--out`` also writes it.
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

from services.gateway.fake_scheduler import FakeScheduler
from services.gateway.tokenizer import load_gateway_tokenizer

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


async def one_stream(client: httpx.AsyncClient, model: str, i: int, max_tokens: int,
                     stop: list[str]) -> tuple[float, int]:
    """(time to first chunk, chunks) of one streaming completion."""
    t0 = time.perf_counter()
    first: float | None = None
    chunks = 0
    body = {"model": model, "prompt": f"request {i}: tell me a story", "max_tokens": max_tokens,
            "stream": True, "stop": stop}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
    return (first or 0.0), chunks


async def run_load(url: str, model: str, gateway_pid: int, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await one_stream(client, model, -1, 8, [])  # warm-up
        proc = psutil.Process(gateway_pid)
        cpu0 = proc.cpu_times()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, model, i, args.max_tokens, args.stop)
                                         for i in range(args.streams)))
        wall = time.perf_counter() - t0
        cpu1 = proc.cpu_times()
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    chunks = sum(n for _, n in results)
    ttfts = sorted(t for t, _ in results)
    return {
        "streams": args.streams, "max_tokens": args.max_tokens, "stop_strings": len(args.stop),
        "tick_ms": args.tick_ms, "chunks": chunks, "wall_s": round(wall, 3),
        "chunks_per_s_wall": round(chunks / wall), "gateway_cpu_s": round(cpu, 3),
        "gateway_cpu_us_per_token": round(cpu / max(chunks, 1) * 1e6, 1),
        "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1000, 1),
        "ttft_max_ms": round(ttfts[-1] * 1000, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.gateway.bench", description=__doc__)
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
        result = asyncio.run(run_load(url, model, gateway.pid, args))
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
