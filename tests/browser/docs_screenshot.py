"""Regenerate the dashboard screenshot in docs/img/ from a real cluster under varying load.

    .venv/bin/python -m tests.browser.docs_screenshot [--out docs/img/dashboard.png] [--seconds 75]

Starts ``ferry serve`` on the tiny test model (priority scheduling, a small running
set), ramps streaming clients up and down at mixed priorities with a few invalid
requests (so rejections show), opens /dashboard in headless Chromium and saves the
top of the page as a compact palette PNG. Not a test: a tool for the docs.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tests.browser.helpers import open_dashboard
from tests.conftest import cached_tiny_model
from tests.integration.conftest import ServeProcess

PHASES = [(2, 15.0), (6, 15.0), (12, 25.0), (4, 12.0), (10, 20.0)]  # (clients, seconds)


def client_loop(base: str, model: str, i: int, active: threading.Event, stop: threading.Event) -> None:
    body = {"model": model, "prompt": f"Shared system prompt for the dashboard demo. Client {i}:",
            "max_tokens": 32 + 16 * (i % 4), "temperature": 0.0, "ignore_eos": True, "stream": True,
            "priority": i % 3}
    with httpx.Client(base_url=base, timeout=120, trust_env=False) as client:
        while not stop.is_set():
            if not active.is_set():
                time.sleep(0.1)
                continue
            with client.stream("POST", "/v1/completions", json=body) as resp:
                for _ in resp.iter_lines():
                    pass


def rejections(base: str, model: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=base, timeout=10, trust_env=False) as client:
        while not stop.wait(2.0):
            client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 10**7})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    parser.add_argument("--height", type=int, default=1180, help="pixels of the page's top to keep")
    args = parser.parse_args()
    from PIL import Image

    tmp = Path(tempfile.mkdtemp(prefix="ferry-shot-"))
    # A small KV cache (40 blocks of 16 tokens) so KV pressure and preemptions show.
    serve = ServeProcess(cached_tiny_model("llama"), tmp, ["--max-num-seqs", "6", "--num-kv-blocks", "40",
                                                           "--scheduling-policy", "priority"]).start()
    stop = threading.Event()
    try:
        serve.wait_ready()
        max_clients = max(n for n, _ in PHASES)
        gates = [threading.Event() for _ in range(max_clients)]
        threads = [threading.Thread(target=client_loop, args=(serve.base_url, serve.model, i, gates[i], stop),
                                    daemon=True) for i in range(max_clients)]
        threads.append(threading.Thread(target=rejections, args=(serve.base_url, serve.model, stop), daemon=True))
        for t in threads:
            t.start()
        with open_dashboard(serve.base_url, width=1400, height=args.height) as (page, _):
            for clients, seconds in PHASES:
                for i, gate in enumerate(gates):
                    gate.set() if i < clients else gate.clear()
                time.sleep(seconds)
            raw = tmp / "raw.png"
            page.screenshot(path=str(raw))
        image = Image.open(raw).convert("RGB").quantize(colors=128)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        image.save(args.out, optimize=True)
        print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
    finally:
        stop.set()
        serve.kill()


if __name__ == "__main__":
    main()
