"""One HTTP request's generation: its choices as scheduler requests, turned into text events.

A request with P prompts and ``n`` choices becomes P*n ``AddRequest``s sharing one
queue. ``Generation.events()`` reads that queue and yields ``ChoiceEvent``s (safe
text increments, their logprobs, a finish reason at the end), running each
choice's ``TextStream`` (detokenizer + stop strings). When a stop string matches,
the choice finishes with ``stop`` and the scheduler is told to abort it, because
only the gateway sees text.

Any failure of one choice (rejected by the scheduler, queue timeout, engine error,
scheduler gone for good) aborts the others and raises an ``APIError`` with the right
status. A scheduler restart is not a failure: the engine client holds the choices and
asks ``continuation()`` for each (see ``engines/resume.py``); the client sees a pause, and the
choice's timings, TTFT and usage stay those of the original request.
``close()`` is synchronous so it can run in the ``finally`` of a cancelled stream:
it aborts whatever has not finished (client gone) and reports every choice to the
metrics.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from services.gateway.api.validation import GenerationSpec
from services.gateway.engines.engine_client import (
    EngineClient,
    EngineFailure,
    EngineUnavailable,
    RequestQueue,
)
from services.gateway.engines.engine_pool import EnginePool
from services.gateway.errors import APIError, retry_after_header, unavailable
from services.gateway.observability.metrics import GatewayMetrics, RequestRecord
from services.gateway.text.detokenizer import TextStream
from services.gateway.text.tokenizer import GatewayTokenizer
from shared.messages import AddRequest, RequestDelta, RequestRejected, RequestTimings, SampleLogprobs

# RequestRejected.reason -> (HTTP status, error code)
_REJECT_STATUS: dict[str, tuple[int, str]] = {
    "queue_full": (429, "queue_full"),
    "queue_tokens_full": (429, "queue_full"),
    "too_long": (400, "context_length_exceeded"),
    "invalid": (400, "invalid_value"),
    "timeout": (503, "queue_timeout"),
    "shutting_down": (503, "shutting_down"),
}


@dataclass
class ChoiceEvent:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[SampleLogprobs]
    finish_reason: str | None = None


@dataclass
class Choice:
    index: int
    req_id: str
    prompt_index: int
    max_tokens: int
    stream: TextStream
    num_prompt_tokens: int
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    timings: RequestTimings | None = None
    reported: bool = False
    admitted: bool = True  # False: refused before running (not a finished request for metrics)
    num_resumes: int = 0  # continuations sent after scheduler restarts


class Generation:
    def __init__(self, engine: EngineClient | EnginePool, tokenizer: GatewayTokenizer, metrics: GatewayMetrics,
                 spec: GenerationSpec, base_id: str, priority: int, api_key_name: str | None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.spec = spec
        self.priority = priority
        self.base_id = base_id
        self.arrival_time = time.time()
        self.queue: RequestQueue = RequestQueue()
        self.adds: list[AddRequest] = spec.add_requests(base_id, engine.gateway_id, self.arrival_time,
                                                        priority, api_key_name)
        self.choices: dict[str, Choice] = {}
        for i, add in enumerate(self.adds):
            p = i // spec.n
            self.choices[add.req_id] = Choice(
                index=i, req_id=add.req_id, prompt_index=p, max_tokens=add.stop.max_tokens,
                num_prompt_tokens=len(add.prompt_token_ids),
                stream=TextStream(tokenizer, add.prompt_token_ids, spec.stop_strings,
                                  spec.include_stop_str_in_output, spec.min_tokens, spec.skip_special_tokens))
        self.error: APIError | None = None
        self.settled = False  # usage and logs were accounted (serving.py)
        self.on_settled: Callable[[], None] | None = None  # serving.py: frees the in-flight slot
        self.client_request_id: str | None = None  # the client's X-Request-Id, for the logs
        # when the HTTP request reached the handler (before tokenizing): the client's clock starts here
        self.received_time = self.arrival_time

    # -- lifecycle -------------------------------------------------------------

    def submit(self) -> None:
        try:
            self.engine.submit(self.adds, self.queue, owner=self)
        except EngineUnavailable as e:
            for c in self.choices.values():
                c.finish_reason = "error"  # never reached the scheduler: nothing to abort
                c.admitted = False
            raise unavailable(f"the engine is not available: {e}", retry_after_s=1.0,
                              code="scheduler_unavailable") from e

    def continuation(self, req_id: str, max_model_len: int, output_token_ids: list[int]) -> AddRequest | EngineFailure:
        """This choice re-submitted to a new scheduler: the tokens routed to it so far as outputs
        (the engine client counts them; some may still wait in the queue, unread)."""
        c = self.choices[req_id]
        add = next(a for a in self.adds if a.req_id == req_id)
        outputs = list(output_token_ids)
        num_tokens = len(add.prompt_token_ids) + len(outputs)
        if max_model_len and num_tokens >= max_model_len:
            return EngineFailure(f"the scheduler restarted and this request ({num_tokens} tokens) has no room "
                                 f"left in max_model_len={max_model_len}")
        if len(outputs) >= add.stop.max_tokens:
            return EngineFailure("the scheduler restarted after this request's last token")
        queue_timeout_s = add.queue_timeout_s
        if c.timings is None and not outputs:
            # never ran: its queue deadline still counts from the original arrival
            timeout = add.queue_timeout_s if add.queue_timeout_s is not None else self.engine.default_queue_timeout_s()
            if timeout is not None and timeout > 0:
                left = timeout - (time.time() - add.arrival_time)
                if left <= 0:
                    return EngineFailure(f"the scheduler restarted and this request waited past its queue timeout "
                                         f"({timeout:g}s) without starting", code="queue_timeout")
                queue_timeout_s = left
        c.num_resumes += 1
        return msgspec.structs.replace(add, output_token_ids=outputs, queue_timeout_s=queue_timeout_s)

    @property
    def unfinished(self) -> list[Choice]:
        return [c for c in self.choices.values() if c.finish_reason is None]

    def close(self) -> None:
        """Abort what has not finished (the client left or another choice failed); report all."""
        left = self.unfinished
        if left:
            self.engine.abort([c.req_id for c in left])
            for c in left:
                c.finish_reason = "abort"
        now = time.time()
        for c in self.choices.values():
            if not c.reported and c.admitted:
                c.reported = True
                self.metrics.on_request_finished(RequestRecord(
                    req_id=c.req_id, priority=self.priority, finish_reason=c.finish_reason or "abort",
                    num_prompt_tokens=c.num_prompt_tokens, num_output_tokens=c.num_output_tokens,
                    num_cached_tokens=c.num_cached_tokens, arrival_time=self.received_time,
                    first_token_time=c.first_token_time, finished_time=now, token_times=c.token_times,
                    timings=c.timings, max_tokens=c.max_tokens, n=self.spec.n))

    # -- events ----------------------------------------------------------------

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        while self.unfinished:
            req_id, item = await self.queue.get()
            choice = self.choices.get(req_id)
            if choice is None or choice.finish_reason is not None:
                continue  # a late delta of a choice already stopped by a stop string
            if isinstance(item, RequestDelta):
                event = self._on_delta(choice, item)
                if event is not None:
                    yield event
            else:
                self._fail(choice, item)

    def _on_delta(self, c: Choice, delta: RequestDelta) -> ChoiceEvent | None:
        now = time.time()
        if delta.new_token_ids:
            c.token_times.append(now)
            if c.first_token_time is None:
                c.first_token_time = now
        c.num_cached_tokens = max(c.num_cached_tokens, delta.num_cached_tokens)
        if delta.timings is not None:
            c.timings = _merge_timings(c.timings, delta.timings)
        texts: list[str] = []
        ids: list[int] = []
        lps: list[SampleLogprobs] = []
        for k, tid in enumerate(delta.new_token_ids):
            texts.append(c.stream.push(tid))
            ids.append(tid)
            c.num_output_tokens += 1
            if delta.logprobs is not None and k < len(delta.logprobs):
                lps.append(delta.logprobs[k])
            if c.stream.stopped:
                break
        if c.stream.stopped:
            c.finish_reason = "stop"
            if delta.finish_reason is None:  # the scheduler would go on: only the gateway sees text
                self.engine.abort([c.req_id])
            else:
                self.engine.forget([c.req_id])
        elif delta.finish_reason in ("stop", "length"):
            texts.append(c.stream.finish())
            c.finish_reason = "stop" if c.stream.stopped else delta.finish_reason
            self.engine.forget([c.req_id])
        elif delta.finish_reason is not None:
            self._fail(c, delta)
        if not texts and not lps and c.finish_reason is None:
            return None
        return ChoiceEvent(c.index, "".join(texts), ids, lps, c.finish_reason)

    def _fail(self, c: Choice, item: RequestDelta | RequestRejected | EngineFailure) -> None:
        """End the whole generation with the error this choice met."""
        err = failure_error(item)
        c.admitted = not isinstance(item, RequestRejected)
        c.finish_reason = item.finish_reason if isinstance(item, RequestDelta) and item.finish_reason else "error"
        self.engine.forget([c.req_id])
        self.error = err
        self.close()
        raise err

    # -- timings ---------------------------------------------------------------

    def timings(self, now: float | None = None) -> dict[str, float | int | None]:
        """Per-request timings for the client (vLLM-style extension), in seconds.

        ``queue_time_s``, ``prefill_time_s``, ``decode_time_s`` and ``num_preemptions``
        come from the scheduler's ``RequestTimings`` (differences of its own clock);
        ``ttft_s`` and ``e2e_s`` from the gateway's clock, counted from the moment the
        HTTP request reached the handler. With several choices: the slowest choice's
        phase times, the earliest first token, preemptions summed. A phase not
        reached (or unknown) is null.
        """
        end = time.time() if now is None else now
        queue: list[float] = []
        prefill: list[float] = []
        decode: list[float] = []
        preemptions = 0
        for c in self.choices.values():
            t = c.timings
            if t is not None:
                preemptions += t.num_preemptions
                if t.first_scheduled_time is not None:
                    queue.append(t.first_scheduled_time - t.arrival_time)
                    if t.first_token_time is not None:
                        prefill.append(t.first_token_time - t.first_scheduled_time)
                if t.first_token_time is not None and t.finished_time is not None:
                    decode.append(t.finished_time - t.first_token_time)
                    continue
            if c.first_token_time is not None and c.token_times and c.finish_reason is not None:
                # stopped by the gateway (stop string): the scheduler never sent a finish time
                decode.append(c.token_times[-1] - c.first_token_time)
        firsts = [c.first_token_time for c in self.choices.values() if c.first_token_time is not None]
        return {"queue_time_s": _longest(queue), "prefill_time_s": _longest(prefill),
                "decode_time_s": _longest(decode),
                "ttft_s": round(max(0.0, min(firsts) - self.received_time), 6) if firsts else None,
                "e2e_s": round(max(0.0, end - self.received_time), 6), "num_preemptions": preemptions}

    # -- usage -----------------------------------------------------------------

    def usage(self) -> dict[str, object]:
        prompt_tokens = 0
        cached = 0
        for p in range(len(self.spec.prompts)):
            group = [c for c in self.choices.values() if c.prompt_index == p]
            prompt_tokens += group[0].num_prompt_tokens
            # prompt tokens count once per prompt; so do the cached ones (best choice's hit)
            cached += max(c.num_cached_tokens for c in group)
        completion = sum(c.num_output_tokens for c in self.choices.values())
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _merge_timings(before: RequestTimings | None, now: RequestTimings) -> RequestTimings:
    """The timings of a choice so far, updated by one delta's. Across a scheduler restart the
    original's arrival, queue and first token stay (the earliest known); the finish is the
    latest scheduler's; preemptions are the largest count reported (within one scheduler
    the count only grows; across a restart this under-counts rather than double-counts)."""
    if before is None:
        return now
    return RequestTimings(
        arrival_time=before.arrival_time,
        first_scheduled_time=before.first_scheduled_time or now.first_scheduled_time,
        first_token_time=before.first_token_time or now.first_token_time,
        finished_time=now.finished_time or before.finished_time,
        num_preemptions=max(before.num_preemptions, now.num_preemptions))


def _longest(values: list[float]) -> float | None:
    return round(max(0.0, max(values)), 6) if values else None


def failure_error(item: RequestDelta | RequestRejected | EngineFailure) -> APIError:
    if isinstance(item, EngineFailure):
        return unavailable(item.message, retry_after_s=1.0, code=item.code)
    if isinstance(item, RequestRejected):
        status, code = _REJECT_STATUS.get(item.reason, (503, item.reason or "rejected"))
        headers = {"Retry-After": retry_after_header(item.retry_after_s)} if status in (429, 503) else None
        return APIError(status, item.message or f"the request was refused ({item.reason})", code=code,
                        headers=headers)
    reason = item.finish_reason
    if reason == "timeout":
        return unavailable(item.error or "the request waited too long in the queue (queue timeout)",
                           retry_after_s=1.0, code="queue_timeout")
    if reason == "abort":
        return unavailable(item.error or "the engine aborted the request", retry_after_s=1.0, code="aborted")
    return APIError(500, item.error or f"the engine failed the request ({reason})", code="engine_error")
