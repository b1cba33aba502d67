"""Real clusters for integration tests: ``ferry serve`` as a child process, plus extra
gateways started against its scheduler.

Everything runs on 127.0.0.1 with a free port and a private ipc runtime folder, in
its own process group; a cluster that is left running by a failed test is killed
(with its whole process tree) at teardown. Workers get one torch thread: the CPUs
are shared.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
TINY_KV_BYTES = 16 << 20  # ~2000 blocks for the tiny model: plenty, and cheap to allocate


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def tail(path: Path, num_chars: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return ""


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    if not predicate():
        raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    try:
        return httpx.get(url, timeout=timeout_s, trust_env=False).status_code
    except httpx.HTTPError:
        return None


def read_metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` as {sample name: value}, label sets summed (one engine, one model)."""
    text = httpx.get(f"{base_url}/metrics", timeout=5.0, trust_env=False).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


class ServeProcess:
    """One ``ferry serve`` child process and what it started."""

    def __init__(self, model: Path | str, tmp: Path, extra_args: list[str] | None = None) -> None:
        self.model = str(model)
        self.port = free_port()
        # ipc paths must stay short (~100 bytes), so not under pytest's deep tmp folders.
        self.runtime_dir = tempfile.mkdtemp(prefix="ferry-t-")
        self.log_path = tmp / f"serve-{self.port}.log"
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.tree: list[psutil.Process] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def gateway_endpoint(self) -> str:
        return f"ipc://{self.runtime_dir}/gateway.sock"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "ferry_cli", "serve", "--model", self.model, "--port", str(self.port),
            "--runtime-dir", self.runtime_dir, "--num-threads", "1", "--kv-cache-memory", str(TINY_KV_BYTES),
            "--shutdown-grace-s", "20", *self.dtype_args(), *self.extra_args,
        ]

    def dtype_args(self) -> list[str]:
        # float32 unless a test asks otherwise: its greedy outputs do not depend on the batch
        # or on recompute after a restart, which the equality checks rely on ('auto' is bf16
        # on CPUs with native bf16).
        return [] if "--dtype" in self.extra_args else ["--dtype", "float32"]

    def start(self) -> ServeProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=child_env(), stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, process_group=0)
        return self

    def wait_ready(self, timeout_s: float = 240.0) -> ServeProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"ferry serve exited with {self.proc.returncode}:\n{tail(self.log_path)}")
            # Ready is when `ferry serve` says so (it prints the URLs after its own /ready
            # check and leaves its start-up phase); /ready alone can answer a moment sooner.
            if http_status(f"{self.base_url}/ready") == 200 and f"{self.base_url}/metrics" in tail(self.log_path, 1 << 30):
                self.tree = self.descendants()
                return self
            time.sleep(0.25)
        raise AssertionError(f"ferry serve not ready in {timeout_s:.0f}s:\n{tail(self.log_path)}")

    def descendants(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def children(self, role: str) -> list[psutil.Process]:
        """Live children whose command runs ``services.<role>``."""
        found = []
        for proc in self.descendants():
            with contextlib.suppress(psutil.Error):
                if f"services.{role}" in proc.cmdline():
                    found.append(proc)
        return found

    def pid(self, role: str) -> int:
        procs = self.children(role)
        assert len(procs) == 1, f"expected one {role}, found {procs}"
        return procs[0].pid

    def log(self) -> str:
        return tail(self.log_path)

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.base_url)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signal ``ferry serve`` and wait; kills the group if it hangs. Returns its exit code."""
        assert self.proc is not None
        tree = self.tree + self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc.pid, tree)
                self.proc.wait()
                raise AssertionError(f"ferry serve did not stop in {timeout_s:.0f}s:\n{self.log()}") from None
        self.tree = tree
        return self.proc.returncode

    def survivors(self, grace_s: float = 5.0) -> list[psutil.Process]:
        """Processes of this cluster's tree still alive after ``grace_s``."""
        deadline = time.monotonic() + grace_s
        alive = self.tree
        while time.monotonic() < deadline:
            alive = [p for p in self.tree if _alive(p)]
            if not alive:
                return []
            time.sleep(0.1)
        return alive

    def kill(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid, self.tree + self.descendants())
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_tree(pid: int, known: list[psutil.Process]) -> None:
    """SIGKILL a process we started and every descendant we saw (by identity, not by name)."""
    procs = list(known)
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True), *procs]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


class GatewayProcess:
    """An extra ``python -m services.gateway`` against an existing scheduler."""

    def __init__(self, model: str, scheduler_endpoint: str, tmp: Path, *extra: str) -> None:
        self.port = free_port()
        self.log_path = tmp / f"gateway-{self.port}.log"
        cmd = [sys.executable, "-m", "services.gateway", "--model", model, "--port", str(self.port),
               "--scheduler-endpoint", scheduler_endpoint, *extra]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, process_group=0)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 120.0) -> GatewayProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited with {self.proc.returncode}:\n{tail(self.log_path)}")
            if http_status(f"{self.base_url}/ready") == 200:
                return self
            time.sleep(0.25)
        raise AssertionError(f"gateway not ready in {timeout_s:.0f}s:\n{tail(self.log_path)}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def openai_client(base_url: str, api_key: str = "unused", timeout_s: float = 120.0):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout_s,
                         http_client=httpx.Client(trust_env=False, timeout=timeout_s))


@pytest.fixture(scope="module")
def serve_cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One ``ferry serve`` on the tiny model, shared by a test module."""
    serve = ServeProcess(tiny_model_dir, tmp_path_factory.mktemp("serve")).start()
    try:
        serve.wait_ready()
        yield serve
    finally:
        serve.kill()
