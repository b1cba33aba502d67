"""Child processes that cannot outlive their parent: start, watch, stop, restart.

Each child runs in its own process group (so a terminal's Ctrl-C reaches only the
supervisor, which then stops the children in order) and asks the kernel to
SIGKILL it if the supervisor dies (``PR_SET_PDEATHSIG``), so even a SIGKILLed
``ferry serve`` leaves no orphan. Stopping signals the whole group, then waits,
then kills the group.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PR_SET_PDEATHSIG = 1
RESTART_WINDOW_S = 60.0


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: die when the parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: process groups are the only guard
        pass


@dataclass
class Child:
    """One supervised process, restartable with the same command and environment."""

    name: str
    role: str  # "redis" | "scheduler" | "worker" | "gateway"
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restart_times: list[float] = field(default_factory=list)
    expected_exit: bool = False  # set while the supervisor itself stops it
    on_output: Callable[[str], None] | None = None
    """Each line the child writes (stdout and stderr), for children that do not log in
    ferry's format; None: the child inherits this process's stdout and stderr."""
    group: str = ""  # the engine it belongs to (data parallel): a scheduler restarts with its own workers

    def start(self) -> None:
        self.expected_exit = False
        piped = self.on_output is not None
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdin=subprocess.DEVNULL, process_group=0, preexec_fn=_die_with_parent,
            stdout=subprocess.PIPE if piped else None, stderr=subprocess.STDOUT if piped else None,
        )
        if piped:
            threading.Thread(target=self._pump, args=(self.proc,), name=f"{self.name}-output", daemon=True).start()

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None and self.on_output is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line:
                self.on_output(line)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def poll(self) -> int | None:
        """The exit code once the process ended, else None (also when never started)."""
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        # Only while the leader is unreaped is its pid (= the group id) surely still ours.
        if self.running():
            assert self.proc is not None
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float, sig: int = signal.SIGTERM) -> int | None:
        """Signal, wait up to ``grace_s``, then SIGKILL the group. Returns the exit code."""
        if self.proc is None:
            return None
        self.expected_exit = True
        self.signal_group(sig)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logging.getLogger("ferry.serve").warning("%s did not stop within %.0fs; killing it", self.name, grace_s)
            self.signal_group(signal.SIGKILL)
            self.proc.wait()
        return self.proc.returncode

    def note_restart(self, now: float) -> int:
        """Record a restart; returns how many happened within the last minute."""
        self.restart_times = [t for t in self.restart_times if now - t < RESTART_WINDOW_S] + [now]
        return len(self.restart_times)


def stop_all(children: list[Child], grace_s: float) -> None:
    """Signal every child first, then wait for each, so the grace periods overlap."""
    for child in children:
        child.expected_exit = True
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        child.stop(max(0.1, deadline - time.monotonic()))


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
