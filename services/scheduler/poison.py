"""Poison requests: a request that crashes the worker must not crash it forever.

A worker crash makes the scheduler recompute every running request
(``Scheduler.preempt_all``). If one of them *is* the cause (an input that passes
validation but breaks the forward, an allocation that fails on a GPU), it would
crash the restarted worker again, and again, until the supervisor gives up on the
whole replica. So every request running at a crash becomes a *suspect* with a crash
count:

- suspects are re-admitted **one at a time**: while one suspect is running and has
  not yet completed a step, no other suspect leaves the waiting queue (the queue
  head waits, so order is kept). A suspect that completes a step is cleared;
- a request present at ``max_request_crashes`` consecutive crashes (counted while
  it stays a suspect) is ended with finish reason ``error`` and a message naming
  the cause, which the gateway answers as a 500; every other request continues.

A crash is one outage of the engine's ranks, however many of them die in it: with
tensor parallelism one rank's death takes the whole group down at once (the service,
ranks.py), so the other ranks' deaths in the same group restart never reach ``on_crash``.

Isolation is what makes the count mean something: without it an innocent request
running beside the poison one would be present at every crash too.
"""

from __future__ import annotations

from collections.abc import Iterable


class CrashSuspects:
    """Crash counts of the requests that were running at recent worker crashes."""

    def __init__(self, max_request_crashes: int) -> None:
        self.max_request_crashes = max_request_crashes  # 0: never end a request for this
        self.counts: dict[str, int] = {}  # req_id -> consecutive crashes it was present at

    def __bool__(self) -> bool:
        return bool(self.counts)

    def on_crash(self, present: Iterable[str]) -> list[str]:
        """Count a crash; returns the ids that reached the limit (forgotten here)."""
        if self.max_request_crashes <= 0:
            return []
        ended = []
        for req_id in present:
            n = self.counts.get(req_id, 0) + 1
            if n >= self.max_request_crashes:
                ended.append(req_id)
                self.counts.pop(req_id, None)
            else:
                self.counts[req_id] = n
        return ended

    def may_admit(self, req_id: str, running: Iterable[str]) -> bool:
        """A suspect runs alone among suspects: not while another one is on probation."""
        if req_id not in self.counts:
            return True
        return not any(r in self.counts for r in running)

    def on_step_done(self, scheduled: Iterable[str]) -> None:
        """Requests that completed a step were not the cause of the earlier crash."""
        for req_id in scheduled:
            self.counts.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self.counts.pop(req_id, None)

    def message(self, count: int) -> str:
        return (f"the worker crashed {count} times in a row while this request was running "
                f"(max_request_crashes={count}); it is ended as the likely cause, so that it cannot "
                f"crash the worker again; the other requests continue")
