"""Waiting queues, one per scheduling policy, and the queue-deadline tracker.

Both queues remove lazily: an aborted or expired request stays in the underlying
deque or heap until it reaches the front, where it is skipped because it is no
longer WAITING. A request is in a queue at most once (it leaves by ``pop`` to
run, or is finished), so status alone tells whether an entry is live. This keeps
abort, expiry and admission O(1) or O(log n) instead of O(queue length). When
dead entries outnumber live ones (plus a slack), the structure is rebuilt
without them, so many aborts behind a blocked head cannot grow it without bound
(amortized O(1) per removal).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from .request import Request, RequestStatus

COMPACT_SLACK = 1024  # dead entries tolerated before a rebuild, beyond the live count


class WaitingQueue(Protocol):
    def push(self, req: Request) -> None: ...
    def push_preempted(self, req: Request) -> None: ...
    def peek(self) -> Request | None: ...
    def pop(self) -> Request: ...
    def in_order(self) -> Iterator[Request]: ...
    def pushed_back_before(self, preempted: Request, req: Request) -> bool: ...
    def discard(self, req: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; a preempted request goes back to the head."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()
        self._live = 0

    def push(self, req: Request) -> None:
        self._q.append(req)
        self._live += 1

    def push_preempted(self, req: Request) -> None:
        self._q.appendleft(req)
        self._live += 1

    def peek(self) -> Request | None:
        q = self._q
        while q and q[0].status is not RequestStatus.WAITING:
            q.popleft()
        return q[0] if q else None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty waiting queue")
        self._q.popleft()
        self._live -= 1
        return req

    def in_order(self) -> Iterator[Request]:
        """The live requests in the order ``pop`` would return them, without popping any
        (valid until the queue next changes)."""
        self.peek()  # drop dead entries at the head once, as pop would, not on every look
        return (r for r in self._q if r.status is RequestStatus.WAITING)

    def pushed_back_before(self, preempted: Request, req: Request) -> bool:
        """Whether ``preempted``, once pushed back with ``push_preempted``, leaves before ``req``."""
        return True

    def discard(self, req: Request) -> None:
        """Call *after* changing ``req.status`` away from WAITING."""
        self._live -= 1
        if len(self._q) > 2 * self._live + COMPACT_SLACK:
            self._q = deque(r for r in self._q if r.status is RequestStatus.WAITING)

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[Request]:
        return (r for r in self._q if r.status is RequestStatus.WAITING)


class PriorityQueue:
    """Lowest ``priority`` value first, then arrival order at this scheduler."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._live = 0

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.seq, req))
        self._live += 1

    # A preempted request keeps its (priority, arrival) key: it is ahead of every
    # later arrival of the same priority, which is "back at the head" for its class.
    push_preempted = push

    def peek(self) -> Request | None:
        heap = self._heap
        while heap and heap[0][2].status is not RequestStatus.WAITING:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty waiting queue")
        heapq.heappop(self._heap)
        self._live -= 1
        return req

    def in_order(self) -> Iterator[Request]:
        """The live requests in the order ``pop`` would return them, without popping any
        (valid until the queue next changes).

        Walks the heap from its root through a frontier heap of entries, so reading the
        first k costs O(k log k), not a sort of the whole queue."""
        self.peek()  # drop dead entries at the top once, as pop would, not on every look
        heap = self._heap
        if not heap:
            return
        frontier = [(heap[0], 0)]  # (entry, its index): entries are unique by seq, so ties never compare further
        while frontier:
            entry, i = heapq.heappop(frontier)
            if entry[2].status is RequestStatus.WAITING:
                yield entry[2]
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))

    def pushed_back_before(self, preempted: Request, req: Request) -> bool:
        """Whether ``preempted``, once pushed back with ``push_preempted``, leaves before ``req``."""
        return (preempted.priority, preempted.seq) < (req.priority, req.seq)

    def discard(self, req: Request) -> None:
        """Call *after* changing ``req.status`` away from WAITING."""
        self._live -= 1
        if len(self._heap) > 2 * self._live + COMPACT_SLACK:
            self._heap = [e for e in self._heap if e[2].status is RequestStatus.WAITING]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in sorted(self._heap) if e[2].status is RequestStatus.WAITING)


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling_policy {policy!r}: expected 'fcfs' or 'priority'")


class DeadlineHeap:
    """Queue deadlines of requests that were never scheduled, earliest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._num_live_hint = 0  # live entries at the last rebuild

    def push(self, req: Request) -> None:
        heap = self._heap
        heapq.heappush(heap, (req.deadline, req.seq, req))
        if len(heap) > 2 * self._num_live_hint + COMPACT_SLACK:
            # Entries of requests that started or ended keep them alive until their deadline: drop them.
            self._heap = [e for e in heap if e[2].status is RequestStatus.WAITING and e[2].first_scheduled_time is None]
            heapq.heapify(self._heap)
            self._num_live_hint = len(self._heap)

    def pop_expired(self, now: float) -> list[Request]:
        """Requests still waiting, never scheduled, whose deadline has passed."""
        expired: list[Request] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            req = heapq.heappop(heap)[2]
            if req.status is RequestStatus.WAITING and req.first_scheduled_time is None:
                expired.append(req)
        return expired

    def __len__(self) -> int:
        return len(self._heap)
