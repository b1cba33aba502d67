"""Start and stop the server under test for an experiment.

Either ``ferry serve`` with the configuration's flags, or any external command
(a peer server: llama.cpp, vLLM, SGLang, ``transformers serve``) given as a
template with ``{host}``, ``{port}`` and ``{model}`` placeholders. The server
runs in its own process group on a free loopback port, its output goes to a
log file, readiness is polled over HTTP, and stopping it signals the whole
group (SIGTERM, then SIGKILL) so no worker process outlives the experiment,
also when the tool itself exits on an error or a signal.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

_LIVE: set[ManagedServer] = set()


class ServerStartError(RuntimeError):
    """The server exited or never became ready."""


@dataclass(frozen=True)
class ServerSpec:
    kind: str = "ferry"
    """'ferry' (``ferry serve``) or 'command' (an external server)."""
    model: str = "smollm2-135m-instruct"
    args: tuple[str, ...] = ()
    """Extra flags for every configuration (baseline and variants)."""
    command: str = ""
    """For kind 'command': the command line, with {host}, {port}, {model} and knob placeholders."""
    ready_path: str = ""
    """Polled until it answers 200 ('': /ready for ferry, /v1/models otherwise)."""
    startup_timeout_s: float = 600.0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ("ferry", "command"):
            raise ValueError(f"server kind must be 'ferry' or 'command', got {self.kind!r}")
        if self.kind == "command" and not self.command:
            raise ValueError("a server of kind 'command' needs a command")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def knob_flags(knobs: dict[str, Any]) -> list[str]:
    """``{"max_num_seqs": 8, "enable_chunked_prefill": False}`` -> ``--max-num-seqs 8 --enable-chunked-prefill false``."""
    flags: list[str] = []
    for key, value in knobs.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        flags += ["--" + key.replace("_", "-"), text]
    return flags


def server_argv(spec: ServerSpec, knobs: dict[str, Any], host: str, port: int) -> list[str]:
    if spec.kind == "ferry":
        base = [sys.executable, "-m", "ferry_cli", "serve", "--host", host, "--port", str(port), "--model", spec.model]
        return base + list(spec.args) + knob_flags(knobs)
    fields = {"host": host, "port": port, "model": spec.model, **knobs}
    argv = [part.format(**fields) for part in shlex.split(spec.command)]
    unused = {k: v for k, v in knobs.items() if "{" + k + "}" not in spec.command}
    return argv + list(spec.args) + knob_flags(unused)


class ManagedServer:
    """One server process group; use as a context manager."""

    def __init__(self, spec: ServerSpec, knobs: dict[str, Any], log_path: Path) -> None:
        self.spec, self.knobs, self.log_path = spec, knobs, log_path
        self.host, self.port = "127.0.0.1", free_port()
        self.argv = server_argv(spec, knobs, self.host, self.port)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command_line(self) -> str:
        return shlex.join(self.argv)

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **self.spec.env}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env,
            )
        _LIVE.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        path = self.spec.ready_path or ("/ready" if self.spec.kind == "ferry" else "/v1/models")
        deadline = time.monotonic() + self.spec.startup_timeout_s
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise ServerStartError(
                        f"server exited with code {self.proc.returncode} before it was ready: "
                        f"{self.command_line}\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.base_url + path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise ServerStartError(
            f"server not ready at {self.base_url}{path} within {self.spec.startup_timeout_s:g}s\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the group (a server drains), then SIGKILL the group and every descendant seen."""
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is None:
            return
        # Servers such as ferry serve put their children in process groups of their own:
        # remember the whole tree now, while the parent still knows it.
        tree = _descendants(proc.pid)
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=grace_s)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                proc.wait(timeout=10)
        _kill_group(proc.pid)
        tree += _descendants(proc.pid)
        _gone, alive = psutil.wait_procs(tree, timeout=5.0)
        for child in alive:
            with contextlib.suppress(psutil.Error):
                child.kill()

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=5.0)
