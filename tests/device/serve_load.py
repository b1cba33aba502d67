"""Stage 4: ``ferry serve --device cuda`` (every process) under the common load.

64 closed-loop streams, 200-token prompts, 64 output tokens (ignore_eos), for a
fixed duration, measured by ``ferry bench run`` against the real HTTP API; the
run's board (board.md) and its JSON come back with the check. The model is
stage 2's random-weight folder with the default model's architecture and the
real SmolLM2 tokenizer. The server is stopped (process group) whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.device.common import SMOLLM2_135M, TINY, Options, SkipStage, Stage, build_model_folder, run_stage

STREAMS, PROMPT_TOKENS, OUTPUT_TOKENS, DURATION_S = 64, 200, 64, 30.0
DRY = dict(streams=4, prompt=16, output=8, duration=6.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"ferry serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"ferry serve not ready after {timeout_s}s")


def body(opts: Options, stage: Stage) -> None:
    import torch

    if opts.device == "cuda" and not torch.cuda.is_available():
        raise SkipStage("no CUDA device")
    arch = TINY if opts.cpu_dry_run else SMOLLM2_135M
    model_dir = build_model_folder(opts.model_dir, arch)
    streams, prompt, output, duration = (
        (DRY["streams"], DRY["prompt"], DRY["output"], DRY["duration"]) if opts.cpu_dry_run
        else (STREAMS, PROMPT_TOKENS, OUTPUT_TOKENS, DURATION_S))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    bench_out = opts.out / "serve"
    log_path = opts.out / "work" / "serve.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "ferry_cli", "serve", "--model", str(model_dir), "--device", opts.device,
           "--port", str(port), "--max-num-seqs", str(max(streams, 8)), "--max-model-len", "1024",
           "--log-format", "text"]
    if opts.cpu_dry_run:
        cmd += ["--kv-cache-memory", str(64 << 20), "--num-threads", "1"]
    stage.record("command", " ".join(cmd[2:]))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The stage's time box sends SIGTERM: turn it into an exception so the server is stopped.
    signal.signal(signal.SIGTERM, _raise_exit)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=Path(__file__).resolve().parents[2])
    try:
        stage.record("ready_s", round(wait_ready(url, proc, 120.0 if not opts.cpu_dry_run else 90.0), 1))
        bench = [sys.executable, "-m", "ferry_cli", "bench", "run", "--base-url", url, "--scenario", "chat",
                 "--scenario-opt", f"prompt_tokens={prompt}:{prompt}", "--scenario-opt",
                 f"output_tokens={output}:{output}", "--scenario-opt", "multi_turn_fraction=0",
                 "--arrival", "closed", "--concurrency", str(streams), "--duration", str(duration), "--ignore-eos",
                 "--tokenizer", str(model_dir), "--out", str(bench_out), "--quiet"]
        subprocess.run(bench, check=True, timeout=duration + 90, cwd=Path(__file__).resolve().parents[2])
        summary = summarize(bench_out)
        for key, value in summary.items():
            stage.record(key, value)
    finally:
        stop(proc)
        stage.record("server_log_tail", log_path.read_text()[-1500:])


def summarize(folder: Path) -> dict[str, object]:
    """The run's summary numbers (results.json) and its board (board.md)."""
    out: dict[str, object] = {}
    results = folder / "results.json"
    if results.is_file():
        data = json.loads(results.read_text())
        for config in data.get("configs", []):
            for run in config.get("runs", []):
                out["summary"] = run.get("summary", {})
    board = folder / "board.md"
    if board.is_file():
        out["board_md"] = board.read_text()[:8000]
    return out


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(f"signal {signum}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


if __name__ == "__main__":
    run_stage("serve", body)
