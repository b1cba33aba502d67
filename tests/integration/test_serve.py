"""``ferry serve`` as an operator runs it: URLs printed once ready, SIGTERM drains an
in-flight stream to its end and leaves no process behind, a SIGKILLed supervisor
takes its children with it, and a child that fails at start-up stops the stack
with a non-zero exit and its error shown.

"No process behind" is checked on the real process table: every child's command
line names the private runtime folder, so a survivor cannot hide.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.integration.conftest import ServeProcess, http_status, wait_for

pytestmark = pytest.mark.slow


def processes_using(runtime_dir: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if runtime_dir in " ".join(proc.info["cmdline"] or []) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue  # it ended while we looked
    return found


def test_sigterm_drains_in_flight_requests_and_leaves_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    serve = ServeProcess(tiny_model_dir, tmp_path).start()
    try:
        serve.wait_ready()
        log = serve.log()
        assert f"{serve.base_url}/v1" in log and f"{serve.base_url}/metrics" in log
        assert f"{serve.base_url}/dashboard" in log
        roles = {role: len(serve.children(role)) for role in ("scheduler", "worker", "gateway")}
        assert roles == {"scheduler": 1, "worker": 1, "gateway": 1}
        assert any("redis-server" in " ".join(p.cmdline()) for p in serve.descendants())

        body = {"model": serve.model, "prompt": "Drain me", "max_tokens": 1000, "stream": True,
                "temperature": 0.0, "ignore_eos": True}
        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{serve.base_url}/v1/completions", json=body, timeout=120,
                              trust_env=False) as resp:
                for line in resp.iter_lines():
                    lines.append(line)
                    first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60), serve.log()
        tree = serve.descendants()
        num_before = len(lines)
        assert serve.stop(signal.SIGTERM, timeout_s=90) == 0, serve.log()
        reader.join(timeout=30)
        # The stream that was running when SIGTERM came finished normally.
        assert len(lines) > num_before + 10, "the stream should still have been running at SIGTERM"
        events = [line for line in lines if line]
        assert events and events[-1] == "data: [DONE]", events[-3:]
        assert any('"finish_reason":"length"' in line.replace(" ", "") for line in events)
        assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert processes_using(serve.runtime_dir) == []
        assert http_status(f"{serve.base_url}/health") is None
    finally:
        serve.kill()


def test_sigkill_of_the_supervisor_takes_the_children(tiny_model_dir: Path, tmp_path: Path) -> None:
    serve = ServeProcess(tiny_model_dir, tmp_path).start()
    try:
        wait_for(lambda: len(processes_using(serve.runtime_dir)) >= 4, 60, what="the children to start")
        children = processes_using(serve.runtime_dir)
        assert serve.stop(signal.SIGKILL, timeout_s=10) == -signal.SIGKILL
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], f"orphans: {[p.cmdline() for p in alive]}"
    finally:
        serve.kill()


def test_child_failing_at_startup_stops_everything(tmp_path: Path) -> None:
    # a folder that looks like a model (so the up-front knob checks pass) but cannot load
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    serve = ServeProcess(broken, tmp_path).start()
    assert serve.proc is not None
    start = time.monotonic()
    code = serve.proc.wait(timeout=180)
    assert code != 0
    log = serve.log()
    assert "during start-up" in log and "broken-model" in log, log
    assert time.monotonic() - start < 180
    wait_for(lambda: processes_using(serve.runtime_dir) == [], 10, what="every child to be gone")


def test_a_missing_model_is_refused_before_anything_starts(tmp_path: Path) -> None:
    serve = ServeProcess(tmp_path / "no-such-model", tmp_path).start()
    assert serve.proc is not None and serve.proc.wait(timeout=60) == 2
    log = serve.log()
    assert "ferry serve: error: --model" in log and "no-such-model" in log, log
    assert "redis" not in log.lower() and "ferry is serving" not in log
