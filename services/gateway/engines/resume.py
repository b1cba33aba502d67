"""Streams the gateway holds across a scheduler restart, and how each one is resumed.

A scheduler crash is a pause, not an error. When the gateway loses its scheduler
(connection dropped, silence, or a new scheduler process announcing a different
``EngineHealth.incarnation``), every in-flight request moves from *live* to *held*:
its HTTP stream stays open and nothing is sent to the client. When a scheduler is
ready again, each held request is re-submitted as a **continuation**: the same prompt,
sampling parameters and stop conditions, plus ``output_token_ids`` = every token already
routed to the request's stream (sent to the client, or still queued for it). Those travel as outputs, not prompt, so ``max_tokens`` (the remaining budget
is ``max_tokens - len(output_token_ids)``), ``min_tokens``, the penalties and the seeded
sampler's position (its generator is keyed by ``(seed, number of outputs so far)``) all
continue as if nothing had happened.

Each continuation goes out under a fresh wire id (``<req_id>~r<k>``): a late delta of the
previous incarnation (a hung scheduler waking up) cannot be mistaken for the new one, and
the old id is aborted like any orphan. The generation keeps seeing its original id.

Bounds (the request then ends with the 503 it would have got without resuming):
``max_resumes`` re-submissions per request, ``resume_timeout_s`` held without a scheduler,
and whatever the owner's ``continuation()`` refuses (no room left in ``max_model_len``,
its queue deadline passed before it ever ran).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from shared.messages import AddRequest, RequestDelta, RequestRejected


@dataclass(frozen=True)
class EngineFailure:
    """Put in a request's queue when the scheduler went away with the request in flight."""

    message: str
    code: str = "scheduler_unavailable"


StreamItem = RequestDelta | RequestRejected | EngineFailure
RequestQueue = asyncio.Queue[tuple[str, StreamItem]]


class Resumable(Protocol):
    """The owner of a request (a ``Generation``): it knows what was streamed so far."""

    def continuation(self, req_id: str, max_model_len: int, output_token_ids: list[int]) -> AddRequest | EngineFailure:
        """The request to re-submit with ``output_token_ids`` (every token routed to it so far,
        consumed or still queued), or the failure to end it with."""
        ...


@dataclass
class Stream:
    """One request this gateway serves: where its deltas go and how it resumes."""

    req_id: str  # the id its owner knows (the first wire id)
    queue: RequestQueue
    owner: Resumable | None  # None: not resumable, fails when the scheduler goes
    wire_id: str = ""
    num_resumes: int = 0
    # every token routed to ``queue`` so far, over all incarnations: a continuation starts
    # after the last of them, even if the owner has not read them all yet
    output_token_ids: list[int] = field(default_factory=list)
    finished: bool = False  # its final delta is routed: nothing to resume
    # the EngineClient's stats generation when it was sent, while it still counts as waiting in
    # the client's sent_since_stats (-1: not counted, or no longer)
    stats_gen: int = -1

    def __post_init__(self) -> None:
        if not self.wire_id:
            self.wire_id = self.req_id

    def next_wire_id(self) -> str:
        self.num_resumes += 1
        return f"{self.req_id}~r{self.num_resumes}"


class StreamTable:
    """Live streams by wire id, held streams by request id, and the id mapping between them."""

    def __init__(self) -> None:
        self.live: dict[str, Stream] = {}  # wire id -> stream
        self.held: dict[str, Stream] = {}  # req id -> stream waiting for a scheduler
        self._wire: dict[str, str] = {}  # req id -> current wire id (live streams)
        self.held_since: float | None = None  # time.monotonic() when the first was held
        self.hold_cause = ""

    def __len__(self) -> int:
        return len(self.live) + len(self.held)

    def add(self, stream: Stream) -> None:
        self.live[stream.wire_id] = stream
        self._wire[stream.req_id] = stream.wire_id

    def by_wire(self, wire_id: str) -> Stream | None:
        return self.live.get(wire_id)

    def remove(self, req_ids: list[str]) -> list[str]:
        """Forget these requests; returns the wire ids of those that were live."""
        wires = []
        for rid in req_ids:
            self.held.pop(rid, None)
            wire = self._wire.pop(rid, None)
            if wire is not None and self.live.pop(wire, None) is not None:
                wires.append(wire)
        if not self.held:
            self.held_since = None
        return wires

    def remove_wire(self, wire_id: str) -> Stream | None:
        stream = self.live.pop(wire_id, None)
        if stream is not None:
            self._wire.pop(stream.req_id, None)
        return stream

    def hold_all(self, cause: str, now: float) -> tuple[list[str], list[Stream]]:
        """Move every live stream to held. Returns (their old wire ids, the non-resumable ones)."""
        old_wires = list(self.live)
        cannot: list[Stream] = []
        for stream in self.live.values():
            if stream.finished:
                continue  # its end is already in its queue; the owner forgets it when it reads it
            if stream.owner is None:
                cannot.append(stream)
            else:
                self.held[stream.req_id] = stream
        self.live.clear()
        self._wire.clear()
        if self.held and self.held_since is None:
            self.held_since = now
            self.hold_cause = cause
        return old_wires, cannot

    def take_held(self) -> list[Stream]:
        held = list(self.held.values())
        self.held.clear()
        self.held_since = None
        return held
