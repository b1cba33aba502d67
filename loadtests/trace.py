"""The trace format: one JSON object per line, one line per request.

A trace is what makes two runs comparable: the same requests, in the same
order, with the same lengths. An operator replays anonymised production
traffic by writing their own file in this format; the built-in scenarios write
the same format.

Request line (only ``max_tokens`` and one of ``messages``/``prompt`` are required)::

    {"id": "chat-0", "offset_s": 0.42, "group": "chat",
     "messages": [{"role": "user", "content": "..."}],      # or "prompt": "..."
     "max_tokens": 64, "prefix_group": null, "cancel_after": null,
     "prompt_tokens": 37}

- ``offset_s``: arrival offset from the start of the trace, in seconds (used by
  the ``trace`` arrival process; the other processes ignore it).
- ``group``: the scenario group the request is reported under.
- ``prefix_group``: requests sharing a prompt prefix carry the same label.
- ``cancel_after``: the client closes the stream after this many output tokens.
- ``prompt_tokens``: token count of the generated content, for the record.
- ``task``, ``check``, ``body``: a request drawn from a task set (loadtests/quality/): its task
  type, how its answer is judged (``{"checker", "expected", "params"}``), and extra request
  fields (``response_format``, ``tools``, ``tool_choice``). Such a request is sent greedy and
  its answer is checked when it finishes. The three are written only when set, so a trace
  without task items keeps the hash it always had.

An optional first line ``{"ferry_trace": VERSION, ...metadata}`` carries the
format version and how the trace was made (scenario, seed, tokenizer). The
content hash covers the request lines only, in their canonical form (sorted
keys, no spaces), so reformatting a file or editing its metadata does not
change it, while any change to the traffic does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE_FORMAT_VERSION = 1


class TraceError(ValueError):
    """A trace file or record that cannot be replayed."""


@dataclass(frozen=True)
class TraceRequest:
    id: str
    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    offset_s: float = 0.0
    group: str = "default"
    prefix_group: str | None = None
    cancel_after: int | None = None
    prompt_tokens: int | None = None
    task: str | None = None
    """The task type of a request drawn from a task set (None: synthetic traffic, not checked)."""
    check: dict[str, Any] | None = None
    """How the answer is judged: ``{"checker": ..., "expected": ..., "params": {...}}``."""
    body: dict[str, Any] | None = None
    """Extra request fields sent as they are (``response_format``, ``tools``, ``tool_choice``)."""

    @property
    def item_id(self) -> str:
        """The task item this request asks (a repeated item's ids end in ``#2``, ``#3``, ...)."""
        return self.id.split("#", 1)[0]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "offset_s": round(self.offset_s, 6), "group": self.group}
        if self.messages is not None:
            out["messages"] = self.messages
        if self.prompt is not None:
            out["prompt"] = self.prompt
        out["max_tokens"] = self.max_tokens
        out["prefix_group"] = self.prefix_group
        out["cancel_after"] = self.cancel_after
        out["prompt_tokens"] = self.prompt_tokens
        for key in ("task", "check", "body"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "") -> TraceRequest:
        def fail(msg: str) -> TraceError:
            return TraceError(f"{where}{msg}")

        if not isinstance(raw, dict):
            raise fail("a request line must be a JSON object")
        messages, prompt = raw.get("messages"), raw.get("prompt")
        if (messages is None) == (prompt is None):
            raise fail("needs exactly one of 'messages' or 'prompt'")
        if messages is not None and (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in messages)
        ):
            raise fail("'messages' must be a non-empty list of {role, content} objects")
        if prompt is not None and not isinstance(prompt, str):
            raise fail("'prompt' must be a string")
        max_tokens = raw.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise fail("'max_tokens' must be a positive integer")
        cancel_after = raw.get("cancel_after")
        if cancel_after is not None and (not isinstance(cancel_after, int) or cancel_after < 1):
            raise fail("'cancel_after' must be a positive integer or null")
        task, check, body = raw.get("task"), raw.get("check"), raw.get("body")
        if (task is None) != (check is None):
            raise fail("'task' and 'check' go together: a task item names its type and how it is judged")
        if check is not None:
            from loadtests.quality.checkers import CHECKERS, spec_problem

            if not isinstance(check, dict) or check.get("checker") not in CHECKERS:
                raise fail(f"'check' must be an object whose 'checker' is one of {', '.join(CHECKERS)}")
            problem = spec_problem(check)
            if problem:
                raise fail(f"'check': {problem}")
        if body is not None and not isinstance(body, dict):
            raise fail("'body' must be an object of extra request fields")
        offset = raw.get("offset_s", 0.0)
        if not isinstance(offset, int | float) or offset < 0:
            raise fail("'offset_s' must be a non-negative number")
        return cls(
            id=str(raw.get("id", "")),
            max_tokens=max_tokens,
            messages=messages,
            prompt=prompt,
            offset_s=float(offset),
            group=str(raw.get("group") or "default"),
            prefix_group=None if raw.get("prefix_group") is None else str(raw["prefix_group"]),
            cancel_after=cancel_after,
            prompt_tokens=raw.get("prompt_tokens"),
            task=None if task is None else str(task),
            check=check,
            body=body,
        )


@dataclass
class Trace:
    requests: list[TraceRequest]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def content_hash(self) -> str:
        return content_hash(self.requests)

    @property
    def groups(self) -> list[str]:
        return sorted({r.group for r in self.requests})

    def natural_rate(self) -> float:
        """Requests per second implied by the trace's own timestamps."""
        if len(self.requests) < 2:
            return 1.0
        span = max(r.offset_s for r in self.requests) - min(r.offset_s for r in self.requests)
        return (len(self.requests) - 1) / span if span > 0 else float("inf")

    @property
    def task_types(self) -> list[str]:
        return sorted({r.task for r in self.requests if r.task is not None})

    def describe(self) -> dict[str, Any]:
        out = {
            "format_version": TRACE_FORMAT_VERSION,
            "sha256": self.content_hash,
            "num_requests": len(self.requests),
            "groups": {g: sum(1 for r in self.requests if r.group == g) for g in self.groups},
            **{k: v for k, v in self.meta.items() if k != "ferry_trace"},
        }
        if self.task_types:
            out["task_requests"] = {t: sum(1 for r in self.requests if r.task == t) for t in self.task_types}
        return out


def canonical_json(record: dict[str, Any]) -> str:
    """One record's canonical line: sorted keys, no spaces, UTF-8 as written (traces and task sets)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def lines_hash(records: Iterable[dict[str, Any]]) -> str:
    """SHA-256 of the records' canonical lines, one ``\\n`` each: what a file's content hash covers."""
    h = hashlib.sha256()
    for record in records:
        h.update(canonical_json(record).encode())
        h.update(b"\n")
    return h.hexdigest()


def canonical_line(request: TraceRequest) -> str:
    return canonical_json(request.to_dict())


def content_hash(requests: list[TraceRequest]) -> str:
    return lines_hash(r.to_dict() for r in requests)


def write_trace(trace: Trace, path: Path) -> str:
    """Write the header and the canonical request lines; returns the content hash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"ferry_trace": TRACE_FORMAT_VERSION, **trace.meta, "sha256": trace.content_hash}
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header, sort_keys=True, separators=(",", ":")) + "\n")
        for request in trace.requests:
            f.write(canonical_line(request) + "\n")
    return trace.content_hash


def json_lines(path: Path, error: type[ValueError], what: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for every non-blank line of a JSON Lines file (traces, task sets);
    ``error`` with the file and line for one that is not JSON."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {what} {path}: {exc}") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{path}:{lineno}: not JSON: {exc}") from exc


def read_trace(path: Path) -> Trace:
    meta: dict[str, Any] = {"path": str(path)}
    requests: list[TraceRequest] = []
    for lineno, raw in json_lines(path, TraceError, "trace"):
        if isinstance(raw, dict) and "ferry_trace" in raw:
            version = raw["ferry_trace"]
            if version != TRACE_FORMAT_VERSION:
                raise TraceError(f"{path}: trace format {version} is not supported (this tool reads {TRACE_FORMAT_VERSION})")
            meta.update({k: v for k, v in raw.items() if k not in ("ferry_trace", "sha256")})
            continue
        request = TraceRequest.from_dict(raw, where=f"{path}:{lineno}: ")
        if not request.id:
            request = TraceRequest(**{**request.__dict__, "id": f"req-{len(requests)}"})
        requests.append(request)
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    return Trace(sorted(requests, key=lambda r: r.offset_s), meta)
