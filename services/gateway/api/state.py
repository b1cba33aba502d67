"""The gateway's shared state: config, tokenizer, engine client, metrics and admission.

One ``GatewayState`` per process, built once at start-up and stored on the app;
route handlers reach it with ``state_of(request)``.

It also holds the gateway's own backpressure, checked before a generation
request costs anything (tokenizing, chat templating, Redis):

- ``InflightLimiter``: at most ``max_inflight_requests`` generation requests open
  at once in this gateway; one more is a 429 ``gateway_overloaded``;
- ``GatewayState.early_refusal``: when the latest ``EngineStats`` (fresh, younger
  than ``STATS_FRESH_S``) show the scheduler's waiting queue at
  ``max_waiting_requests``, and still full after what this gateway sent since
  and what drained since at the measured rate, a 429 ``queue_full`` without
  tokenizing. The scheduler's own check stays authoritative: stats can be
  stale in either direction, and a request that passes here can still be
  refused there.
"""

from __future__ import annotations

import collections
import math
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import msgspec
from fastapi import Request

from services.gateway.admission.auth import Admission
from services.gateway.api.body_check import RequestLimits
from services.gateway.api.validation import ServingLimits
from services.gateway.engines.engine_pool import EnginePool
from services.gateway.errors import APIError, retry_after_header
from services.gateway.observability.metrics import GatewayMetrics
from services.gateway.text.tokenizer import GatewayTokenizer, load_gateway_tokenizer
from services.gateway.text.tool_parsers import make_parser
from shared.config import GatewayConfig, config_as_dict

try:  # the Redis engine registry (admission's module); the gateway serves without it
    from services.gateway.engines.registry import EngineRegistry
except ImportError:  # pragma: no cover - only while that module is absent
    EngineRegistry = None  # type: ignore[assignment,misc]


STATS_FRESH_S = 2.0  # older EngineStats are not trusted to refuse a request early
RATE_WINDOW_S = 10.0  # how far back the gateway's completion rate is measured
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1.0, 60.0
RETRY_AFTER_UNKNOWN_S = 5.0  # no measured rate to estimate from (the scheduler's choice too)


def drain_retry_after_s(backlog: int, rate_per_s: float) -> float:
    """Seconds until ``backlog`` requests have likely drained at ``rate_per_s``, clamped to 1..60."""
    if rate_per_s <= 0 or not math.isfinite(rate_per_s):
        return RETRY_AFTER_UNKNOWN_S
    return round(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, backlog / rate_per_s)), 1)


class InflightSlot:
    """One open generation request; ``release()`` is idempotent (it runs from several paths)."""

    __slots__ = ("_limiter", "_released")

    def __init__(self, limiter: InflightLimiter) -> None:
        self._limiter = limiter
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter._on_release()


class InflightLimiter:
    """A bound on this gateway's open generation requests (``limit`` 0: unbounded)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._finished: collections.deque[float] = collections.deque()  # monotonic release times

    def acquire(self) -> InflightSlot:
        """A slot, or a 429 ``gateway_overloaded`` APIError when all are taken."""
        if 0 < self.limit <= self.in_flight:
            retry = drain_retry_after_s(self.in_flight, self.completion_rate())
            raise APIError(429, f"the gateway is at its limit of {self.limit} open generation requests; "
                                f"retry after {retry_after_header(retry)} s",
                           code="gateway_overloaded", headers={"Retry-After": retry_after_header(retry)})
        self.in_flight += 1
        return InflightSlot(self)

    def completion_rate(self) -> float:
        """Generation requests released per second over the last ``RATE_WINDOW_S``."""
        self._trim(time.monotonic())
        return len(self._finished) / RATE_WINDOW_S

    def _on_release(self) -> None:
        self.in_flight -= 1
        now = time.monotonic()
        self._finished.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._finished and self._finished[0] < now - RATE_WINDOW_S:
            self._finished.popleft()


def ferry_version() -> str:
    try:
        return metadata.version("ferry")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def new_gateway_id() -> str:
    return f"gw-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class GatewayState:
    config: GatewayConfig
    gateway_id: str
    tokenizer: GatewayTokenizer
    engine: EnginePool
    metrics: GatewayMetrics
    admission: Admission
    served_names: frozenset[str]
    registry: Any = None  # EngineRegistry when available
    background: set[Any] = field(default_factory=set)
    started_at: int = field(default_factory=lambda: int(time.time()))
    inflight: InflightLimiter = field(default_factory=lambda: InflightLimiter(0))

    def early_refusal(self) -> APIError | None:
        """429 ``queue_full`` when fresh EngineStats show the scheduler's queue already full."""
        stats, age = self.engine.stats, self.engine.stats_age_s()
        if stats is None or age is None or age > STATS_FRESH_S:
            return None
        try:
            bound = int(stats.config["max_waiting_requests"])
        except (KeyError, ValueError):
            return None  # a scheduler that does not report its bound: let it decide
        # the queue now, as best this gateway can tell: the snapshot, plus what this gateway
        # sent since (not refused, not running yet), minus what drained meanwhile at the measured rate;
        # refusing only when that is still full keeps a stale snapshot from starving the engine
        estimate = stats.num_waiting + self.engine.sent_since_stats - stats.drain_rate_rps * age
        if estimate < bound:
            return None
        # say the estimate this refusal rests on: the snapshot alone can be seconds old and
        # read "0 of 2" while this gateway's own requests fill the queue
        waiting = max(bound, math.ceil(estimate))
        retry = retry_after_header(drain_retry_after_s(waiting, stats.drain_rate_rps))
        return APIError(429, f"the waiting queue is full (about {waiting} of {bound} requests, counting "
                             f"those sent since the scheduler's last report and not running yet); retry after {retry} s",
                        code="queue_full", headers={"Retry-After": retry})

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.config.model

    def max_model_len(self) -> int:
        return self.engine.max_model_len or self.tokenizer.max_position_embeddings

    def request_limits(self) -> RequestLimits:
        """The per-request item limits the body check applies (body_check.py)."""
        c = self.config
        return RequestLimits(max_stop_strings=c.max_stop_strings, max_logit_bias=c.max_logit_bias,
                             max_messages=c.max_messages, max_tools=c.max_tools, max_prompts=c.max_prompts,
                             max_list_items=c.max_list_items, max_token_ids=self.max_model_len())

    def limits(self) -> ServingLimits:
        return ServingLimits(self.served_names, self.config.max_n, self.max_model_len(),
                             tool_call_parser=self.config.tool_call_parser)

    def health(self) -> dict[str, Any]:
        ready, reason = self.engine.readiness()
        return {"status": "ok", "ready": ready, "reason": reason, "gateway_id": self.gateway_id,
                "version": ferry_version(), "model": self.model_name, "scheduler": self.engine.status(),
                "redis": self.admission.health(),
                "in_flight": {"requests": self.inflight.in_flight, "limit": self.inflight.limit},
                "registry": self.registry.health() if self.registry is not None else {"registry": "absent"},
                "engines": self.engine.engine_rows()}

    def effective_config(self) -> dict[str, Any]:
        gateway = config_as_dict(self.config)
        if gateway.get("api_key"):
            gateway["api_key"] = "<set>"
        if gateway.get("admin_key"):
            gateway["admin_key"] = "<set>"
        if gateway.get("redis_url"):
            gateway["redis_url"] = _redact_url(str(gateway["redis_url"]))
        stats, health = self.engine.stats, self.engine.health
        if health is not None and health.config:
            scheduler: dict[str, Any] = dict(health.config)
        else:  # a scheduler that reports its knobs only as strings
            scheduler = {k: _typed(v) for k, v in (stats.config if stats is not None else {}).items()}
        workers = []
        for info in health.workers if health is not None else []:
            worker = msgspec.to_builtins(info)
            worker.pop("type", None)  # the message tag
            workers.append(worker)
        return {"gateway": gateway, "gateway_id": self.gateway_id, "model": self.model_name,
                "max_model_len": self.max_model_len(), "scheduler": scheduler, "workers": workers}


def _typed(text: str) -> int | float | bool | str:
    """'64' -> 64, '0.25' -> 0.25, 'True' -> True; anything else stays a string."""
    if text in ("True", "False"):
        return text == "True"
    for convert in (int, float):
        try:
            return convert(text)  # type: ignore[no-any-return]
        except ValueError:
            pass
    return text


def _redact_url(url: str) -> str:
    """Hide a password in redis://user:password@host."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at:
        return url
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}"


def state_of(request: Request) -> GatewayState:
    st = request.app.state.gateway
    assert isinstance(st, GatewayState)
    return st


def build_state(config: GatewayConfig, tokenizer: GatewayTokenizer | None = None,
                gateway_id: str | None = None) -> GatewayState:
    gid = gateway_id or new_gateway_id()
    tok = tokenizer or load_gateway_tokenizer(config.model, config.cache_dir)
    make_parser(config.tool_call_parser)  # an unknown name fails at start, not on the first request
    model_name = config.served_model_name or config.model
    metrics_ = GatewayMetrics(model_name, config.metrics_compat == "vllm",
                              max_model_len=tok.max_position_embeddings or 32768)
    engine = EnginePool(config, gid, metrics_)  # one engine or many (data parallel): the same interface
    registry = EngineRegistry(config, gid) if EngineRegistry is not None else None
    return GatewayState(config=config, gateway_id=gid, tokenizer=tok, engine=engine, metrics=metrics_,
                        admission=Admission(config, gid), served_names=frozenset({model_name}),
                        registry=registry, inflight=InflightLimiter(config.max_inflight_requests))
