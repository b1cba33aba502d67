"""Authentication under a flood of strangers: what keyless requests cost the gateway and its clients.

A real ``ferry serve`` (scheduler, worker, its own loopback gateway) runs the model;
a second gateway, the one measured, joins the same scheduler from inside a network
namespace this benchmark creates, bound there as ``--host 0.0.0.0`` with an
``--api-key`` and an ``--admin-key``. Two loads reach it:

- the paying clients: a paced load of streaming chat requests with the valid key at
  ``--rate`` (2/s), sent from inside the namespace (address 127.0.0.1);
- the flood: ``--flood-rps`` (50/s) keyless chat requests, each a maximum-size body
  (the gateway's ``--max-body-bytes``) with a fresh JSON schema, sent from outside the
  namespace to its veth address, i.e. from an address of their own, so the
  per-address failure throttle (which answers them 429 after the first
  ``--auth-failure-limit``) does not touch the paying clients.

Phases alternate baseline / flood / baseline / flood (``--rounds``), each
``--duration`` seconds, as experiments do, and the verdict uses the load tool's noise
rule (loadtests/noise.py): the clients' TTFT p95 under the flood is "worse" only when
it is worse than every baseline repeat allows. The gateway's CPU per refused request
is (its CPU time during a flood phase - during the mean baseline phase) / refusals.

Needs root and ``ip`` (iproute2). Writes ``--out`` (JSON) and prints a summary:

    python -m benchmarks.serving.auth_flood --out results/auth-flood.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil

from loadtests.client import ClientConfig, send_request, stream_session
from loadtests.noise import noisy_verdict
from loadtests.trace import TraceRequest

KEY = "bench-key-" + uuid.uuid4().hex[:8]
ADMIN = "bench-admin-" + uuid.uuid4().hex[:8]
NS_ADDR, HOST_ADDR = "10.231.7.2", "10.231.7.1"  # the namespace's end (the gateway) and ours (the flood)
PORT = 8471


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


class Namespace:
    """A network namespace with a veth pair to this one; removed on exit."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.name, self.outer, self.inner = f"ferry-af-{tag}", f"fafo{tag}", f"fafi{tag}"

    def __enter__(self) -> Namespace:
        sh("ip", "netns", "add", self.name)
        sh("ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        sh("ip", "link", "set", self.inner, "netns", self.name)
        sh("ip", "addr", "add", f"{HOST_ADDR}/30", "dev", self.outer)
        sh("ip", "link", "set", self.outer, "up")
        self.run("ip", "addr", "add", f"{NS_ADDR}/30", "dev", self.inner)
        self.run("ip", "link", "set", self.inner, "up")
        self.run("ip", "link", "set", "lo", "up")
        return self

    def run(self, *args: str) -> None:
        sh("ip", "netns", "exec", self.name, *args)

    def __exit__(self, *exc: object) -> None:
        sh("ip", "link", "del", self.outer, check=False)
        sh("ip", "netns", "del", self.name, check=False)


def wait_http(url: str, timeout_s: float, ns: Namespace | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ns is None:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            else:
                out = sh("ip", "netns", "exec", ns.name, sys.executable, "-c",
                         f"import httpx,sys; sys.exit(0 if httpx.get({url!r}, timeout=2).status_code == 200 else 1)",
                         check=False)
                if out.returncode == 0:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become ready in {timeout_s} s")


def flood_body(size: int, n: int) -> bytes:
    """A chat request of exactly ``size`` bytes with a schema no earlier request had (the padding is
    spliced in as bytes: serializing 4 MiB per request would cost this client more than the gateway)."""
    schema = {"type": "object", "properties": {f"p{n}_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 9 + 1}}}$"}
                                               for i in range(64)}, "required": [f"p{n}_0"]}
    body: dict[str, Any] = {"model": "smollm2-135m-instruct", "max_tokens": 16,
                            "messages": [{"role": "user", "content": "hello"}],
                            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                            "user": ""}
    raw = json.dumps(body).encode()
    assert raw.endswith(b'""}')
    return raw[:-2] + b"x" * max(0, size - len(raw)) + b'"}'


async def flood(url: str, rps: float, duration_s: float, size: int) -> dict[str, int]:
    statuses: dict[str, int] = {}
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        async def one(n: int) -> None:
            try:
                async with session.post(url, data=flood_body(size, n),
                                        headers={"content-type": "application/json"}) as resp:
                    await resp.read()
                    statuses[str(resp.status)] = statuses.get(str(resp.status), 0) + 1
            except aiohttp.ClientError as exc:
                statuses[type(exc).__name__] = statuses.get(type(exc).__name__, 0) + 1

        start = time.monotonic()
        tasks = []
        n = 0
        while time.monotonic() - start < duration_s:
            tasks.append(asyncio.ensure_future(one(n)))
            n += 1
            await asyncio.sleep(max(0.0, start + n / rps - time.monotonic()))
        await asyncio.gather(*tasks)
    return statuses


async def paced(base_url: str, key: str, rate: float, duration_s: float, max_tokens: int) -> list[dict[str, Any]]:
    config = ClientConfig(base_url=base_url, model="smollm2-135m-instruct", api_key=key, ignore_eos=True)
    records = []
    async with stream_session(120.0) as session:
        start = time.perf_counter()
        tasks = []
        for i in range(int(rate * duration_s)):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            req = TraceRequest(id=f"r{i}", max_tokens=max_tokens,
                               messages=[{"role": "user", "content": f"Tell me about the number {i}."}])
            tasks.append(asyncio.ensure_future(send_request(session, req, config, start)))
        records = await asyncio.gather(*tasks)
    return [r.to_dict() for r in records]


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = sorted(r["ttft_s"] for r in records if r["status"] == "ok" and r["ttft_s"] is not None)
    ok = len(ttfts)

    def pct(p: float) -> float | None:
        return ttfts[min(ok - 1, int(p * ok))] if ok else None

    return {"requests": len(records), "ok": ok, "errors": len(records) - ok, "ttft_p50_s": pct(0.5),
            "ttft_p95_s": pct(0.95), "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None}


def phase(ns: Namespace, gateway: psutil.Process, flood_rps: float, args: argparse.Namespace,
          body_bytes: int) -> dict[str, Any]:
    """One phase: the paced clients (inside the namespace) with or without the flood (from here)."""
    cmd = ["ip", "netns", "exec", ns.name, sys.executable, "-m", "benchmarks.serving.auth_flood", "--role", "paced",
           "--rate", str(args.rate), "--duration", str(args.duration), "--max-tokens", str(args.max_tokens),
           "--key", KEY]
    cpu0, own0, busy0 = gateway.cpu_times(), psutil.Process().cpu_times(), _busy()
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    statuses: dict[str, int] = {}
    if flood_rps > 0:
        statuses = asyncio.run(flood(f"http://{NS_ADDR}:{PORT}/v1/chat/completions", flood_rps, args.duration,
                                     body_bytes))
    out, _ = client.communicate(timeout=args.duration + 300)
    cpu1, own1, busy1 = gateway.cpu_times(), psutil.Process().cpu_times(), _busy()
    records = json.loads(out)
    return {"flood_rps": flood_rps, "flood_statuses": statuses, "refused": sum(
        v for k, v in statuses.items() if k in ("401", "429")),
        "gateway_cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
        # the flood's own sender shares this machine's cores with the engine and the clients
        "flood_client_cpu_s": (own1.user + own1.system) - (own0.user + own0.system),
        "machine_busy_share": round((busy1[0] - busy0[0]) / max(1e-9, busy1[1] - busy0[1]), 3), **summary(records)}


def _busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat's first line)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="bench", choices=["bench", "paced"])
    ap.add_argument("--rate", type=float, default=2.0, help="paying clients' requests per second")
    ap.add_argument("--flood-rps", type=float, default=50.0)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    ap.add_argument("--rounds", type=int, default=2, help="baseline/flood pairs (the baseline runs this often)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20, help="the measured gateway's limit")
    ap.add_argument("--out", default="results/auth-flood.json")
    ap.add_argument("--key", default="", help="(--role paced) the paying clients' key")
    args = ap.parse_args(argv)
    if args.role == "paced":
        print(json.dumps(asyncio.run(paced(f"http://127.0.0.1:{PORT}", args.key, args.rate, args.duration,
                                           args.max_tokens))))
        return 0
    if shutil.which("ip") is None or os.geteuid() != 0:
        print("auth_flood needs root and iproute2 ('ip') to create its network namespace", file=sys.stderr)
        return 2
    runtime = Path(tempfile.mkdtemp(prefix="ferry-af-"))
    serve = subprocess.Popen([str(Path(sys.executable).parent / "ferry"), "serve", "--runtime-dir", str(runtime),
                              "--port", "8470"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    phases: list[dict[str, Any]] = []
    try:
        wait_http("http://127.0.0.1:8470/ready", 300)
        with Namespace() as ns:
            env = {**os.environ, "FERRY_API_KEY": KEY, "FERRY_ADMIN_KEY": ADMIN}
            gw = subprocess.Popen(["ip", "netns", "exec", ns.name, sys.executable, "-m", "services.gateway",
                                   "--host", "0.0.0.0", "--port", str(PORT), "--max-body-bytes", str(args.max_body_bytes),
                                   "--scheduler-endpoint", f"ipc://{runtime}/gateway.sock"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_http(f"http://127.0.0.1:{PORT}/ready", 120, ns)
                gateway = psutil.Process(gw.pid)
                phase(ns, gateway, 0, argparse.Namespace(**{**vars(args), "duration": 10}), args.max_body_bytes)
                for _ in range(args.rounds):
                    for rps in (0.0, args.flood_rps):
                        result = phase(ns, gateway, rps, args, args.max_body_bytes)
                        phases.append(result)
                        print(json.dumps(result), flush=True)
            finally:
                gw.terminate()
                gw.wait(timeout=30)
    finally:
        serve.terminate()
        serve.wait(timeout=60)
        shutil.rmtree(runtime, ignore_errors=True)
    base = [p for p in phases if p["flood_rps"] == 0]
    floods = [p for p in phases if p["flood_rps"] > 0]
    base_cpu = statistics.fmean(p["gateway_cpu_s"] for p in base)
    per_refusal_ms = [1000 * (p["gateway_cpu_s"] - base_cpu) / max(1, p["refused"]) for p in floods]
    verdicts = [noisy_verdict("ttft_p95_s <= baseline.ttft_p95_s", p, base)[0] for p in floods]
    report = {"args": vars(args), "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": "),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "phases": phases,
              "gateway_cpu_ms_per_refusal": per_refusal_ms, "ttft_p95_verdicts": verdicts}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    def p95s(rows: list[dict[str, Any]]) -> str:
        return ", ".join("n/a" if r["ttft_p95_s"] is None else f"{r['ttft_p95_s']:.3f}" for r in rows)

    cpu_text = ", ".join(f"{x:.2f}" for x in per_refusal_ms)
    print(f"gateway CPU per refused request: {cpu_text} ms (target < 5); baseline TTFT p95 {p95s(base)} s, "
          f"under the flood {p95s(floods)} s: {', '.join(verdicts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
