"""Every engine replica this gateway can send to, and the routing of each request to one.

The pool holds one ``EngineClient`` per engine (its own DEALER, liveness and
stats) and answers the same questions a single client does (``submit``,
``abort``, ``readiness``, ``stats``...), so the rest of the gateway is the same
with one engine or many. Members come from:

- ``scheduler_endpoint``: one endpoint, or several separated by commas (named
  ``0``, ``1``, ... in that order; ``ferry serve --data-parallel-size`` names its
  engines the same way);
- the Redis registry (``ferry:replicas``, written by each engine's scheduler,
  services/scheduler/registration.py) when ``redis_url`` is set and
  ``discover_engines`` is on: a registered engine of this model joins within one
  discovery interval; one whose registration expired (its TTL) leaves, and its
  requests are treated like those of a dead engine.

Routing (services/gateway/engines/routing.py) picks one engine per HTTP request (all its
choices together, so ``n`` > 1 shares the prompt's cached blocks). When an engine
goes away, every one of its requests that has not produced a token yet is sent
again to another engine (same request id: the client sees a delay, not an
error); requests that already streamed tokens are held and resumed on their engine
when its scheduler is back (resume.py), and end with the client's retryable error
(503 + Retry-After, from ``EngineFailure``) only when it is not back in time or
leaves the pool first. A draining engine's
``shutting_down`` refusal and a full queue's ``queue_full`` are re-routed the same
way (to an engine not tried yet; the refusal stands when there is none).

Each engine's stats feed a metrics view with its own ``engine`` label
(``engine_metrics``); ``ferry:requests_routed_total{engine,outcome}`` counts
where requests went.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import socket
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter
from redis.exceptions import RedisError

from services.gateway.admission import keystore
from services.gateway.engines.engine_client import (
    EngineClient,
    EngineFailure,
    EngineUnavailable,
    RequestQueue,
    StreamItem,
)
from services.gateway.engines.resume import Resumable
from services.gateway.engines.routing import EngineLoad, policy_from_config, prefix_key, route
from services.gateway.observability.metrics import GatewayMetrics
from services.gateway.observability.metrics_families import Fan
from services.gateway.observability.metrics_window import LiveWindow
from shared.config import GatewayConfig
from shared.messages import AddRequest, EngineHealth, EngineStats, RequestDelta, RequestRejected

log = logging.getLogger("ferry.gateway.pool")

REGISTRY_NAMESPACE = "ferry:"  # services/scheduler/registration.py writes here
DEFAULT_BLOCK_SIZE = 16  # until an engine reports its own
# refusals another engine may not give: draining, or a full queue (try one with room before a 429)
REROUTE_REASONS = frozenset({"shutting_down", "queue_full", "queue_tokens_full"})


def engine_metrics(base: GatewayMetrics, engine: str) -> GatewayMetrics:
    """A view of ``base`` whose engine-side series carry ``engine=<engine>``.

    It shares the registry and the metric families; it has its own label values,
    its own memory of the scheduler's cumulative totals (so each engine's counters
    advance by that engine's increases) and its own sample window.
    """
    if base._base.get("engine") == engine:
        return base
    view = copy.copy(base)
    labels = {**base._base, "engine": engine}
    view._base = labels
    for name, value in vars(base).items():
        if isinstance(value, Fan):
            setattr(view, name, value.rebased(labels))
    view._last_totals = {}
    view._seen_labels = {}
    view.last_stats = None
    view.last_health = None
    view.window = LiveWindow(window_s=base.window.window_s, history_s=base.window.history_s)
    return view


@dataclass
class Member:
    name: str
    endpoint: str
    client: EngineClient
    metrics: GatewayMetrics
    discovered: bool  # from the registry (may leave) rather than the static list
    routed_total: int = 0


class _RoutedQueue(RequestQueue):
    """The queue one engine's client fills for one submit: it re-routes requests that never started."""

    def __init__(self, pool: EnginePool, target: RequestQueue, adds: list[AddRequest], tried: set[str],
                 owner: Resumable | None = None) -> None:
        super().__init__()
        self.pool = pool
        self.owner = owner  # resume.py: the requests survive their scheduler's restart
        self.target = target
        self.adds = {a.req_id: a for a in adds}
        self.tried = tried
        self.started: set[str] = set()

    def can_reroute(self, req_id: str) -> bool:
        """Whether a request of this submit that lost its engine could go to another one now."""
        return req_id in self.adds and req_id not in self.started and self.pool.has_other_engine(self.tried)

    def put_nowait(self, item: tuple[str, StreamItem]) -> None:
        req_id, msg = item
        if isinstance(msg, RequestDelta) and (msg.new_token_ids or msg.finish_reason is not None):
            self.started.add(req_id)
        retryable = isinstance(msg, EngineFailure) or (
            isinstance(msg, RequestRejected) and msg.reason in REROUTE_REASONS)
        add = self.adds.get(req_id)
        if retryable and add is not None and req_id not in self.started and self.pool.reroute(add, self):
            return
        self.target.put_nowait(item)


@dataclass
class EnginePool:
    config: GatewayConfig
    gateway_id: str
    metrics: GatewayMetrics
    members: dict[str, Member] = field(default_factory=dict)
    discovery_interval_s: float = 1.0

    def __post_init__(self) -> None:
        c = self.config
        self.policy = policy_from_config(c)
        self._owner: dict[str, str] = {}  # req_id -> member name
        self._counter = 0
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._redis: Any = None
        self.discovery_error = ""
        self._host = socket.gethostname()
        self.routed = Counter("ferry:requests_routed", "Requests sent to each engine (rerouted: sent again "
                              "after their engine went away before they started).",
                              ["model_name", "engine", "outcome"], registry=self.metrics.registry)
        endpoints = [e.strip() for e in c.scheduler_endpoint.split(",") if e.strip()]
        for i, endpoint in enumerate(endpoints):
            self._add_member(str(i), endpoint, discovered=False)

    # -- members -----------------------------------------------------------------

    def _add_member(self, name: str, endpoint: str, discovered: bool) -> Member:
        view = engine_metrics(self.metrics, name)
        client = EngineClient(endpoint, self.gateway_id, self.config.heartbeat_interval_s,
                              self.config.scheduler_timeout_s, on_stats=view.on_engine_stats,
                              on_health=view.on_engine_health, max_resumes=self.config.max_resumes,
                              resume_timeout_s=self.config.resume_timeout_s,
                              on_resumed=self.metrics.on_requests_resumed)
        member = Member(name, endpoint, client, view, discovered)
        self.members[name] = member
        for outcome in ("routed", "rerouted"):
            self.routed.labels(self.metrics.model_name, name, outcome)
        return member

    def engine_views(self) -> list[tuple[str, GatewayMetrics]]:
        """(name, metrics view) of every engine, for the dashboard's totals and request tables."""
        return [(m.name, m.metrics) for m in self.members.values()]

    async def start(self) -> None:
        for member in list(self.members.values()):
            await member.client.start()
        if self.config.redis_url and self.config.discover_engines:
            self._redis = keystore.async_client(self.config.redis_url, 0.5)
            self._task = asyncio.get_running_loop().create_task(self._discover_loop(), name="ferry-discovery")

    async def close(self) -> None:
        self._closing = True  # a closing gateway fails its requests; it does not re-route them
        if self._task is not None:
            self._task.cancel()
            # Bounded, and the loop also reads `_closing`: asyncio.wait_for (Python 3.11) can
            # swallow a cancellation that lands as the call it wraps completes, and an unbounded
            # await then never returns (seen once in CI as a 600 s hang of this close).
            task, self._task = self._task, None
            await asyncio.wait({task}, timeout=self.discovery_interval_s + 2.0)
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a loop that ended by itself logs nothing at exit
        for member in list(self.members.values()):
            await member.client.close()
        if self._redis is not None:
            await self._redis.aclose()

    async def discover(self) -> None:
        """One look at the registry: join new engines of this model, drop expired ones."""
        records = await self._registered()
        if records is None:
            return  # Redis unreachable: keep what we have, static members still serve
        model = self.config.model
        live: dict[str, str] = {}
        for rec in records:
            if rec.get("model") and rec["model"] != model:
                continue
            if str(rec.get("endpoint", "")).startswith("ipc://") and rec.get("host") != self._host:
                continue  # an ipc:// socket of another host: unreachable from here
            live[str(rec["name"])] = str(rec["endpoint"])
        known = {m.endpoint for m in self.members.values()}
        for name, endpoint in sorted(live.items()):
            member = self.members.get(name)
            if member is not None and member.endpoint != endpoint and member.discovered:
                await self._drop(member, "moved to another address")
                member = None
            if member is None and endpoint not in known:
                log.info("engine joined", extra={"engine": name, "endpoint": endpoint})
                await self._add_member(name, endpoint, discovered=True).client.start()
        for member in list(self.members.values()):
            if member.discovered and member.name not in live:
                await self._drop(member, "its registration expired")

    async def _drop(self, member: Member, why: str) -> None:
        log.warning("engine left", extra={"engine": member.name, "endpoint": member.endpoint, "reason": why})
        self.members.pop(member.name, None)
        member.metrics.running.set(0)
        member.metrics.waiting.set(0)
        await member.client.close()  # its unstarted requests re-route through their queues

    async def _registered(self) -> list[dict[str, Any]] | None:
        try:
            names = await asyncio.wait_for(
                self._redis.zrangebyscore(f"{REGISTRY_NAMESPACE}replicas", time.time(), "+inf"), 0.5)
            if not names:
                return []
            raw = await asyncio.wait_for(self._redis.mget(
                [f"{REGISTRY_NAMESPACE}replica:{n.decode() if isinstance(n, bytes) else n}" for n in names]), 0.5)
        except (TimeoutError, RedisError, OSError) as exc:
            if not self.discovery_error:
                log.warning("engine discovery: redis unreachable (%s)", exc)
            self.discovery_error = f"{type(exc).__name__}: {exc}"[:200]
            return None
        self.discovery_error = ""
        return [json.loads(item) for item in raw if item]

    async def _discover_loop(self) -> None:
        while not self._closing:
            try:
                await self.discover()
            except Exception:  # noqa: BLE001 - discovery must never stop; the next round retries
                log.exception("engine discovery failed")
            await asyncio.sleep(self.discovery_interval_s)

    # -- routing -----------------------------------------------------------------

    def _loads(self, exclude: Collection[str] = ()) -> list[EngineLoad]:
        out = []
        for m in self.members.values():
            if m.name in exclude:
                continue
            s = m.client.stats
            out.append(EngineLoad(m.name, m.client.ready(), s.num_running if s else 0, s.num_waiting if s else 0,
                                  m.client.sent_since_stats))
        return out

    def _block_size(self) -> int:
        for m in self.members.values():
            if m.client.health is not None and m.client.health.block_size:
                return int(m.client.health.block_size)
        return DEFAULT_BLOCK_SIZE

    def _order(self, adds: list[AddRequest], exclude: Collection[str] = ()) -> list[str]:
        key = prefix_key(adds[0].prompt_token_ids, self.policy.prefix_blocks, self._block_size())
        self._counter += 1
        return route(key, self._loads(exclude), self.policy, self._counter)

    def _send(self, adds: list[AddRequest], queue: _RoutedQueue, order: list[str], outcome: str) -> str | None:
        for name in order:
            member = self.members[name]
            try:
                member.client.submit(adds, queue, owner=queue.owner)
            except EngineUnavailable:
                continue
            queue.tried.add(name)
            for add in adds:
                self._owner[add.req_id] = name
            member.routed_total += len(adds)
            self.routed.labels(self.metrics.model_name, name, outcome).inc(len(adds))
            return name
        return None

    def submit(self, adds: list[AddRequest], queue: RequestQueue, owner: Resumable | None = None) -> None:
        """Send one HTTP request's choices to one engine; EngineUnavailable if none takes them.
        With an ``owner`` the engine's client holds them over a restart of that engine's scheduler."""
        order = self._order(adds)
        if not order:
            raise EngineUnavailable(self.readiness()[1])
        if self._send(adds, _RoutedQueue(self, queue, adds, set(), owner), order, "routed") is None:
            raise EngineUnavailable("no engine is reachable")

    def reroute(self, add: AddRequest, failed: _RoutedQueue) -> bool:
        """Send a request that never started to another engine; False if there is none."""
        if self._closing:
            return False
        tried = set(failed.tried)
        order = self._order([add], exclude=tried)
        if not order:
            return False
        name = self._send([add], _RoutedQueue(self, failed.target, [add], tried, failed.owner), order, "rerouted")
        if name is not None:
            log.info("request re-routed", extra={"req_id": add.req_id, "engine": name})
        return name is not None

    def has_other_engine(self, tried: Collection[str]) -> bool:
        """Is there a ready engine this request has not been sent to yet?"""
        return any(name not in tried and m.client.readiness()[0] for name, m in self.members.items())

    def default_queue_timeout_s(self) -> float | None:
        """The engines' ``queue_timeout_s`` as last reported (the first engine that reports one)."""
        for member in self.members.values():
            timeout = member.client.default_queue_timeout_s()
            if timeout is not None:
                return timeout
        return None

    def abort(self, req_ids: list[str]) -> None:
        for name, ids in self._by_owner(req_ids).items():
            member = self.members.get(name)
            if member is not None:
                member.client.abort(ids)

    def forget(self, req_ids: list[str]) -> None:
        for name, ids in self._by_owner(req_ids).items():
            member = self.members.get(name)
            if member is not None:
                member.client.forget(ids)

    def _by_owner(self, req_ids: list[str]) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for rid in req_ids:
            name = self._owner.pop(rid, None)
            if name is not None:
                groups.setdefault(name, []).append(rid)
        return groups

    # -- the single-engine questions, answered for the pool ------------------------

    def _preferred(self) -> Member | None:
        """The engine a request would most likely go to now: the least loaded ready one."""
        ready = [m for m in self.members.values() if m.client.ready()]
        pool = ready or list(self.members.values())
        if not pool:
            return None
        return min(pool, key=lambda m: ((m.client.stats.num_running + m.client.stats.num_waiting)
                                        if m.client.stats else 0, m.name))

    @property
    def endpoint(self) -> str:
        return ",".join(m.endpoint for m in self.members.values())

    @property
    def stats(self) -> EngineStats | None:
        m = self._preferred()
        return m.client.stats if m else None

    @property
    def health(self) -> EngineHealth | None:
        m = self._preferred()
        return m.client.health if m else None

    @property
    def sent_since_stats(self) -> int:
        m = self._preferred()
        return m.client.sent_since_stats if m else 0

    def stats_age_s(self) -> float | None:
        m = self._preferred()
        return m.client.stats_age_s() if m else None

    @property
    def max_model_len(self) -> int:
        lens = [m.client.max_model_len for m in self.members.values() if m.client.ready() and m.client.max_model_len]
        return min(lens) if lens else 0

    def readiness(self) -> tuple[bool, str]:
        if not self.members:
            return False, "no engine known yet"
        states = {m.name: m.client.readiness() for m in self.members.values()}
        ready = [n for n, (ok, _) in states.items() if ok]
        if len(states) == 1:
            return next(iter(states.values()))
        if ready:
            return True, "ready" if len(ready) == len(states) else f"{len(ready)} of {len(states)} engines ready"
        return False, "; ".join(f"engine {n}: {why}" for n, (_, why) in sorted(states.items()))

    def ready(self) -> bool:
        return self.readiness()[0]

    def engine_rows(self) -> list[dict[str, Any]]:
        """One row per engine for /health, /ready and the dashboard."""
        rows = []
        for m in sorted(self.members.values(), key=lambda m: m.name):
            ok, reason = m.client.readiness()
            s = m.client.stats
            rows.append({
                "name": m.name, "endpoint": m.endpoint, "ready": ok, "reason": reason,
                "source": "registry" if m.discovered else "static",
                "num_running": s.num_running if s else None, "num_waiting": s.num_waiting if s else None,
                "kv_usage": round(s.kv_usage, 4) if s else None,
                "num_kv_blocks_total": s.num_kv_blocks_total if s else None,
                "prefix_cache_hit_rate": (round(s.prefix_cache_hits_total / s.prefix_cache_queries_total, 4)
                                          if s and s.prefix_cache_queries_total else None),
                "routed_total": m.routed_total,
                "incarnation": m.client.incarnation or None,  # changes when the engine's scheduler restarts
            })
        return rows

    def status(self) -> dict[str, object]:
        ready, reason = self.readiness()
        m = self._preferred()
        base: dict[str, object] = dict(m.client.status()) if m else {}
        in_flight = sum(int(x.client.status().get("in_flight", 0) or 0)  # type: ignore[call-overload]
                        for x in self.members.values())
        return {**base, "endpoint": self.endpoint, "ready": ready, "reason": reason, "in_flight": in_flight,
                "routing_policy": self.policy.policy, "engines": self.engine_rows(),
                **({"discovery_error": self.discovery_error} if self.discovery_error else {})}
