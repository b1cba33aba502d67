"""What the scheduler service knows about its worker ranks, and when one is dead.

A rank is *ready* from its ``WorkerReady`` until it is declared dead. It is dead
when its process is silent (no heartbeat and no result) for
``worker_heartbeat_timeout_s``, when a different pid speaks for the same rank (the
supervisor already restarted it), or when the service says so (step timeout,
fatal ``WorkerError``). The table only decides; the service acts (abandons the
step, ``preempt_all()``, tells gateways, or asks a *lingering* process, one that is
dead to us or announced itself to a previous scheduler, to exit and be restarted).

Tensor-parallel ranks (``WorkerReady.tensor_parallel_size`` above 1) are shards of one
model: none can run without the others, and the supervisor restarts them together. So
the death of one is the death of the group (``group_restarts``): the service marks every
rank dead at once, and the engine is down until each rank has announced a new process.
Deaths the scheduler notices later in that restart (the other ranks' new pids, their old
processes' last heartbeats) are then not news, so the outage is one crash, not one per rank.
A process once declared dead never counts as a rank's live process again (unless its pid
announces itself anew: containers reuse pids).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shared.messages import WorkerHeartbeat, WorkerReady

log = logging.getLogger("ferry.scheduler")

Death = tuple[int, str]  # (rank, why)
STRAY_GRACE_S = 3.0
MAX_DEAD_PIDS = 256  # processes remembered as dead (a few per restart; the oldest are forgotten)


@dataclass
class RankState:
    ready: bool = False
    info: WorkerReady | None = None
    pid: int = 0
    last_seen: float = 0.0
    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    device_memory_peak_bytes: int = 0


class RankTable:
    def __init__(self, num_workers: int, block_size: int, heartbeat_timeout_s: float) -> None:
        self.block_size = block_size
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.states = [RankState() for _ in range(num_workers)]
        self.strays: dict[int, float] = {}  # pid -> first heartbeat without a WorkerReady
        self.dead_pids: dict[int, None] = {}  # processes declared dead, oldest first

    def __len__(self) -> int:
        return len(self.states)

    def valid(self, rank: int) -> bool:
        return 0 <= rank < len(self.states)

    def all_ready(self) -> bool:
        return all(s.ready for s in self.states)

    def ready_ranks(self) -> list[int]:
        return [i for i, s in enumerate(self.states) if s.ready]

    def missing_ranks(self) -> list[int]:
        return [i for i, s in enumerate(self.states) if not s.ready]

    def infos(self) -> list[WorkerReady]:
        return [s.info for s in self.states if s.info is not None]

    def group_restarts(self) -> bool:
        """Whether the ranks are tensor-parallel shards (one rank's death is the group's)."""
        return len(self.states) > 1 and any(i.tensor_parallel_size > 1 for i in self.infos())

    def on_ready(self, msg: WorkerReady, now: float) -> tuple[list[Death], bool]:
        """(deaths, accepted): a new pid replaces (kills) the process we used."""
        state = self.states[msg.rank]
        if state.ready and msg.pid == state.pid:
            return [], False  # a repeated announcement of a process we already use
        deaths: list[Death] = []
        if state.ready:
            deaths.append((msg.rank, f"re-announced with a new pid {msg.pid} (was {state.pid})"))
        if msg.block_size != self.block_size:
            log.error("rank %d uses block_size %d but the scheduler uses %d; ignoring it",
                      msg.rank, msg.block_size, self.block_size)
            return deaths, False
        return deaths, True

    def accept(self, msg: WorkerReady, now: float) -> None:
        state = self.states[msg.rank]
        state.ready, state.info, state.pid, state.last_seen = True, msg, msg.pid, now
        self.dead_pids.pop(msg.pid, None)  # a reused pid (one process per container) is this new process

    def on_heartbeat(self, msg: WorkerHeartbeat, now: float) -> tuple[list[Death], bool]:
        """(deaths, lingering): lingering means a process we declared dead still runs."""
        state = self.states[msg.rank]
        if msg.pid in self.dead_pids:
            # A process declared dead (a group restart took it down, or a late heartbeat queued
            # before it died): never a sign that the live one died, and it must exit if it runs.
            return [], True
        if state.ready and msg.pid and msg.pid != state.pid:
            # A new process for this rank already runs, so the one we use is gone.
            return [(msg.rank, f"a new process (pid {msg.pid}) heartbeats for this rank")], False
        if not state.ready and msg.pid and msg.pid == state.pid:
            # Declared dead (a missed step deadline) but alive: its batch state is stale
            # and it will not announce itself again unless it restarts.
            return [], True
        if not state.ready and msg.pid:
            # Heartbeats without a WorkerReady: a worker that announced itself to a previous
            # scheduler process (this one restarted). It holds that scheduler's batch and
            # will never announce again, so it must restart. A fresh worker announces before
            # its first heartbeat; the grace covers the two sockets racing.
            first = self.strays.setdefault(msg.pid, now)
            return [], now - first > STRAY_GRACE_S
        if msg.pid == state.pid or not state.ready:
            state.last_seen = now
            state.rss_bytes = msg.rss_bytes
            state.peak_rss_bytes = msg.peak_rss_bytes
            state.device_memory_peak_bytes = msg.device_memory_peak_bytes
        return [], False

    def on_result(self, rank: int, now: float) -> bool:
        """A result counts only from a ready rank (late answers of dead ones do not)."""
        state = self.states[rank]
        if state.ready:
            state.last_seen = now
        return state.ready

    def mark_dead(self, rank: int) -> bool:
        """True if the rank was ready (so this is news)."""
        state = self.states[rank]
        was_ready, state.ready = state.ready, False
        if was_ready and state.pid:
            self.dead_pids[state.pid] = None
            if len(self.dead_pids) > MAX_DEAD_PIDS:
                del self.dead_pids[next(iter(self.dead_pids))]
        return was_ready

    def silent(self, now: float) -> list[Death]:
        return [
            (rank, f"no heartbeat for {now - s.last_seen:.1f}s")
            for rank, s in enumerate(self.states)
            if s.ready and now - s.last_seen > self.heartbeat_timeout_s
        ]

    def pid(self, rank: int) -> int:
        return self.states[rank].pid

    def memory(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(rss, peak rss, device peak) per worker, keyed "worker<rank>", from heartbeats."""
        rss: dict[str, int] = {}
        peak: dict[str, int] = {}
        device: dict[str, int] = {}
        for rank, state in enumerate(self.states):
            if state.rss_bytes:
                rss[f"worker{rank}"] = state.rss_bytes
                peak[f"worker{rank}"] = state.peak_rss_bytes
            if state.device_memory_peak_bytes:
                device[f"worker{rank}"] = state.device_memory_peak_bytes
        return rss, peak, device
