"""Task items as trace requests: a trace of a task set alone, or a fraction of a scenario's traffic.

A task item becomes a trace request that carries its task type, how it is judged and its extra
request fields (``TraceRequest.task``/``check``/``body``). Items are drawn in a seeded shuffled
order, every item once before any repeats (a repeat's id gets ``#2``, ``#3``, ...), so the
same set, seed and count always give the same trace and the same content hash.

Mixed into a scenario's trace, an item takes a chosen request's place: its arrival offset is
kept (so the traffic's timing is unchanged) and its prompt, answer length and task replace the
synthetic ones. The items' group is ``tasks`` in the per-group latency tables; their quality is
reported per task type.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from loadtests.quality.tasks import TaskItem, TaskSet
from loadtests.trace import Trace, TraceRequest

TASK_GROUP = "tasks"


def item_request(item: TaskItem, request_id: str, offset_s: float, group: str = TASK_GROUP) -> TraceRequest:
    """One trace request asking ``item``."""
    check: dict[str, Any] = {"checker": item.checker, "expected": item.expected}
    if item.params:
        check["params"] = item.params
    if item.request:
        # the checker reads the request's schema and tools (json_schema, tool_call)
        check["request"] = item.request
    return TraceRequest(
        id=request_id, max_tokens=item.max_tokens, messages=item.messages, prompt=item.prompt,
        offset_s=offset_s, group=group, task=item.task, check=check, body=dict(item.request) or None,
    )


def draw(taskset: TaskSet, seed: int) -> Iterator[tuple[TaskItem, str]]:
    """Items in a seeded order, each once per round; yields (item, request id)."""
    rng = random.Random(f"ferry-tasks:{taskset.content_hash}:{seed}")
    rounds = 0
    while True:
        rounds += 1
        order = list(taskset.items)
        rng.shuffle(order)
        for item in order:
            yield item, item.id if rounds == 1 else f"{item.id}#{rounds}"


def taskset_trace(taskset: TaskSet, num_requests: int, seed: int, rate: float = 1.0) -> Trace:
    """A trace of ``num_requests`` task items with Poisson offsets at ``rate`` (the nominal rate)."""
    if num_requests < 1:
        raise ValueError("num_requests must be at least 1")
    rng = random.Random(f"ferry-tasks-arrivals:{seed}")
    t, requests = 0.0, []
    for (item, rid), _ in zip(draw(taskset, seed), range(num_requests), strict=False):
        requests.append(item_request(item, rid, round(t, 6)))
        t += rng.expovariate(rate)
    meta = {"scenario": "tasks", "seed": seed, "nominal_rate": rate, "taskset": _described(taskset)}
    return Trace(requests, meta)


def full_pass_trace(taskset: TaskSet) -> Trace:
    """Every item once, in the set's order: the quality pass an experiment runs on each server."""
    requests = [item_request(item, item.id, 0.0) for item in taskset.items]
    return Trace(requests, {"scenario": "tasks-full-pass", "taskset": _described(taskset)})


def mix_tasks(trace: Trace, taskset: TaskSet, fraction: float, seed: int) -> Trace:
    """``trace`` with a seeded ``fraction`` of its requests replaced by task items (offsets kept)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the task fraction must be in [0, 1], not {fraction}")
    if fraction == 0.0:
        return trace
    rng = random.Random(f"ferry-tasks-mix:{seed}")
    items = draw(taskset, seed)
    requests = []
    for request in trace.requests:
        if rng.random() < fraction:
            item, rid = next(items)
            requests.append(item_request(item, rid, request.offset_s))
        else:
            requests.append(request)
    meta = dict(trace.meta)
    meta.update({"task_fraction": fraction, "taskset": _described(taskset)})
    return Trace(requests, meta)


def _described(taskset: TaskSet) -> dict[str, Any]:
    described = taskset.describe()
    return {k: described[k] for k in ("name", "version", "sha256", "num_items", "task_types") if k in described}
