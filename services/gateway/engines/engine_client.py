"""The gateway's connection to a scheduler: one zmq DEALER, per-request queues, liveness.

The DEALER's routing id is this gateway's id, so the scheduler's ROUTER can send
each gateway the deltas of its own requests. It carries ``AddRequest``,
``AbortRequest`` and a ``GatewayHeartbeat`` every ``heartbeat_interval_s``; it
receives ``RequestDeltas``, ``RequestRejected``, ``EngineStats`` and
``EngineHealth``.

Liveness has two signals:

- a socket monitor sees the connection drop the moment a scheduler process dies
  and come back when a new one binds the endpoint (zmq reconnects by itself);
- silence: no message for ``scheduler_timeout_s`` (a hung scheduler).

Either way the scheduler is *down*: ``ready()`` is false and new requests are refused
with 503. In-flight requests are *held* (``resume.py``): their streams stay open and,
once a scheduler is ready again, each is re-submitted as a continuation. A request that
cannot be resumed (``max_resumes`` 0 or spent, ``resume_timeout_s`` passed, no room
left) gets an ``EngineFailure`` in its queue. A new ``EngineHealth.incarnation`` means
a new scheduler process even when no drop was seen: live requests are held and resumed
the same way. On a lost connection the cached ``EngineHealth`` is dropped, so readiness
after a restart needs a fresh one (the gateway sends a heartbeat the moment it connects;
the scheduler answers a gateway it has not seen with ``EngineHealth``).
``ZMQ_IMMEDIATE`` keeps messages from queueing for a scheduler that is not
connected: a send then fails at once instead of reaching a later scheduler.

All sends are non-blocking and synchronous (``DONTWAIT``), so an abort can be
sent from a ``finally`` block of a cancelled stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from services.gateway.engines.resume import (
    EngineFailure,
    RequestQueue,
    Resumable,
    Stream,
    StreamItem,
    StreamTable,
)
from services.gateway.observability.metrics_families import (
    CAUSE_CONNECTION_LOST,
    CAUSE_NEW_INCARNATION,
    CAUSE_SILENT,
)
from shared.messages import (
    AbortRequest,
    AddRequest,
    EngineHealth,
    EngineStats,
    GatewayHeartbeat,
    RequestDeltas,
    RequestRejected,
    encode,
    to_gateway_decoder,
)

log = logging.getLogger("ferry.gateway.engine")

__all__ = ["EngineClient", "EngineFailure", "EngineUnavailable", "RequestQueue", "StreamItem"]


class EngineUnavailable(Exception):
    """The scheduler cannot take a request now (down, not ready, or not reachable)."""


class EngineClient:
    def __init__(self, endpoint: str, gateway_id: str, heartbeat_interval_s: float = 1.0,
                 scheduler_timeout_s: float = 10.0,
                 on_stats: Callable[[EngineStats], None] | None = None,
                 on_health: Callable[[EngineHealth], None] | None = None,
                 max_resumes: int = 0, resume_timeout_s: float = 300.0,
                 on_resumed: Callable[[str, int], None] | None = None) -> None:
        self.endpoint = endpoint
        self.gateway_id = gateway_id
        self.heartbeat_interval_s = heartbeat_interval_s
        self.scheduler_timeout_s = scheduler_timeout_s
        self._on_stats = on_stats
        self._on_health = on_health
        self.max_resumes = max_resumes
        self.resume_timeout_s = resume_timeout_s
        self._on_resumed = on_resumed  # (cause, number of requests re-submitted)
        self.incarnation = ""  # the scheduler process whose health we last saw
        self.connected = False
        self.last_seen: float | None = None  # time.monotonic() of the last message
        self.health: EngineHealth | None = None
        self.stats: EngineStats | None = None
        self.stats_received: float | None = None  # time.monotonic() when ``stats`` arrived
        # requests this gateway sent since ``stats``, not refused and not running yet: the
        # queue the stats describe has likely grown by these (see GatewayState.early_refusal); a
        # request leaves the count at its first delta (it runs: it is no longer waiting), at its
        # refusal, and with the next EngineStats, which counts it itself (stats_gen moves on)
        self.sent_since_stats = 0
        self.stats_gen = 0
        self.down_reason = "no scheduler seen yet"
        self._streams = StreamTable()
        self._orphans: set[str] = set()  # failed locally; abort them once a scheduler is back
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.gateway_id.encode())
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        self._sock = sock
        self._tasks = [asyncio.create_task(self._recv_loop(), name="engine-recv"),
                       asyncio.create_task(self._monitor_loop(monitor), name="engine-monitor"),
                       asyncio.create_task(self._heartbeat_loop(), name="engine-heartbeat")]
        log.info("connecting to scheduler", extra={"endpoint": self.endpoint, "gateway_id": self.gateway_id})

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self._streams.live:
            self._send(AbortRequest(gateway_id=self.gateway_id, req_ids=list(self._streams.live)))
        self._fail_all("the gateway is shutting down")
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._sock, self._ctx = None, None

    # -- state -----------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        """(ready, why not): scheduler connected and recently heard, every worker up."""
        if not self.connected:
            return False, f"scheduler not connected ({self.down_reason})"
        if self.health is None:
            return False, "waiting for the scheduler's health report"
        h = self.health
        if not h.scheduler_ready:
            return False, f"scheduler not ready{': ' + h.detail if h.detail else ''}"
        missing = sorted(set(range(h.num_workers)) - set(h.workers_ready))
        if h.num_workers <= 0 or missing:
            return False, f"workers not ready: {missing if missing else 'none reported'}"
        return True, "ready"

    def ready(self) -> bool:
        return self.readiness()[0]

    def stats_age_s(self) -> float | None:
        """Seconds since the latest EngineStats arrived (this gateway's clock); None if none yet,
        or if the scheduler is down (its last numbers no longer describe anything)."""
        if self.stats_received is None or not self.connected:
            return None
        return time.monotonic() - self.stats_received

    @property
    def max_model_len(self) -> int:
        return self.health.max_model_len if self.health is not None else 0

    def status(self) -> dict[str, object]:
        ready, reason = self.readiness()
        h = self.health
        return {
            "endpoint": self.endpoint,
            "connected": self.connected,
            "ready": ready,
            "reason": reason,
            "last_seen_s_ago": None if self.last_seen is None else round(time.monotonic() - self.last_seen, 3),
            "num_workers": h.num_workers if h else None,
            "workers_ready": list(h.workers_ready) if h else [],
            "model": h.model if h else None,
            "max_model_len": h.max_model_len if h else None,
            "in_flight": len(self._streams),
            "held": len(self._streams.held),
            "incarnation": self.incarnation or None,
        }

    # -- requests ----------------------------------------------------------------

    def submit(self, adds: list[AddRequest], queue: RequestQueue, owner: Resumable | None = None) -> None:
        """Register the requests' queue, then send them; EngineUnavailable if that cannot happen.

        With an ``owner``, the requests survive a scheduler restart (see ``resume.py``)."""
        ready, reason = self.readiness()
        if not ready:
            raise EngineUnavailable(reason)
        for add in adds:
            self._streams.add(Stream(add.req_id, queue, owner, stats_gen=self.stats_gen))
        for i, add in enumerate(adds):
            if not self._send(add):
                sent = [a.req_id for a in adds[:i]]
                self.forget([a.req_id for a in adds])
                if sent:
                    self._send(AbortRequest(gateway_id=self.gateway_id, req_ids=sent))
                raise EngineUnavailable("the scheduler is not reachable")
        self.sent_since_stats += len(adds)

    def abort(self, req_ids: list[str]) -> None:
        """Tell the scheduler to drop these requests (best effort) and stop routing their deltas."""
        wires = self._streams.remove(req_ids)
        if wires and not self._send(AbortRequest(gateway_id=self.gateway_id, req_ids=wires)):
            self._orphans.update(wires)

    def forget(self, req_ids: list[str]) -> None:
        self._streams.remove(req_ids)

    # -- internals ---------------------------------------------------------------

    def _send(self, msg: msgspec.Struct) -> bool:
        if self._sock is None:
            return False
        fut = self._sock.send(encode(msg), flags=zmq.DONTWAIT)
        # DONTWAIT resolves at once: sent, or zmq.Again with no connected scheduler
        assert isinstance(fut, asyncio.Future)
        return fut.done() and fut.exception() is None

    def _mark_down(self, reason: str, drop_health: bool, cause: str) -> None:
        was_up = self.connected
        self.connected = False
        if drop_health:  # a new scheduler process must report its own health
            self.health = None
        self.down_reason = reason
        if was_up:
            log.warning("scheduler down", extra={"reason": reason, "in_flight": len(self._streams)})
        self._hold_all(cause, f"the scheduler is unavailable ({reason})")

    def _hold_all(self, cause: str, message: str) -> None:
        """The scheduler holding our live requests is gone: hold them (or fail them)."""
        if self.max_resumes <= 0:
            self._fail_all(message)
            return
        old_wires, cannot = self._streams.hold_all(cause, time.monotonic())
        self._orphans.update(old_wires)  # a scheduler that still knows them must drop them
        for stream in cannot:
            stream.queue.put_nowait((stream.req_id, EngineFailure(message)))
        # With several engines (engine_pool.py), a request that never started is better sent to
        # another engine at once than held until this scheduler returns: its queue says whether
        # one can take it. Started requests stay held and resume here (a pause, not an error).
        for req_id, stream in list(self._streams.held.items()):
            can_reroute = getattr(stream.queue, "can_reroute", None)
            if not stream.output_token_ids and can_reroute is not None and can_reroute(req_id):
                del self._streams.held[req_id]
                stream.queue.put_nowait((req_id, EngineFailure(message)))
        if not self._streams.held:
            self._streams.held_since = None
        if self._streams.held:
            log.warning("holding in-flight requests until a scheduler is ready",
                        extra={"cause": cause, "held": len(self._streams.held)})

    def _fail_all(self, message: str, code: str = "scheduler_unavailable") -> None:
        self._orphans.update(self._streams.live)
        streams = list(self._streams.live.values()) + self._streams.take_held()
        self._streams = StreamTable()
        for stream in streams:
            stream.queue.put_nowait((stream.req_id, EngineFailure(message, code)))

    def _resume_held(self) -> None:
        """A scheduler is ready: re-submit every held request as a continuation."""
        cause = self._streams.hold_cause
        held = self._streams.take_held()
        if self._orphans and self._send(AbortRequest(gateway_id=self.gateway_id, req_ids=sorted(self._orphans))):
            self._orphans.clear()
        resumed = 0
        for i, stream in enumerate(held):
            assert stream.owner is not None
            if stream.num_resumes >= self.max_resumes:
                failure = EngineFailure(f"the scheduler was lost {stream.num_resumes + 1} times while this request "
                                        f"ran; it is not resumed again (max_resumes={self.max_resumes})")
            else:
                failure = None
                cont = stream.owner.continuation(stream.req_id, self.max_model_len, list(stream.output_token_ids))
                if isinstance(cont, EngineFailure):
                    failure = cont
            if failure is not None:
                stream.queue.put_nowait((stream.req_id, failure))
                continue
            assert isinstance(cont, AddRequest)
            stream.wire_id = stream.next_wire_id()
            self._streams.add(stream)
            if not self._send(msgspec.structs.replace(cont, req_id=stream.wire_id)):
                # gone again before we finished: hold the rest for the next one
                self._streams.remove_wire(stream.wire_id)
                for s in [stream, *held[i + 1:]]:
                    self._streams.held[s.req_id] = s
                self._streams.held_since = time.monotonic()
                self._streams.hold_cause = cause
                break
            resumed += 1
        if resumed:
            log.warning("resumed in-flight requests on a new scheduler", extra={"cause": cause, "resumed": resumed})
            if self._on_resumed is not None:
                self._on_resumed(cause, resumed)

    def _expire_held(self, now: float) -> None:
        since = self._streams.held_since
        if since is not None and now - since > self.resume_timeout_s:
            message = (f"the scheduler is unavailable ({self.down_reason}) and did not come back within "
                       f"resume_timeout_s={self.resume_timeout_s:g}s")
            for stream in self._streams.take_held():
                stream.queue.put_nowait((stream.req_id, EngineFailure(message)))

    def _left_waiting(self, stream: Stream) -> None:
        """``stream`` is no longer waiting in the scheduler: out of ``sent_since_stats`` if counted."""
        if stream.stats_gen == self.stats_gen:
            self.sent_since_stats = max(0, self.sent_since_stats - 1)
        stream.stats_gen = -1

    def _maybe_resume(self) -> None:
        if self._streams.held and self.ready():
            self._resume_held()

    def _on_connected(self) -> None:
        self.connected = True
        self.last_seen = time.monotonic()
        log.info("scheduler connected", extra={"endpoint": self.endpoint})
        self._send(GatewayHeartbeat(gateway_id=self.gateway_id, time=time.time()))
        if self._orphans and self._send(AbortRequest(gateway_id=self.gateway_id, req_ids=sorted(self._orphans))):
            self._orphans.clear()
        self._maybe_resume()

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, RequestDeltas):
            for delta in msg.deltas:
                stream = self._streams.by_wire(delta.req_id)
                if stream is not None:
                    self._left_waiting(stream)
                    stream.output_token_ids.extend(delta.new_token_ids)
                    stream.finished = stream.finished or delta.finish_reason is not None
                    stream.queue.put_nowait((stream.req_id, delta))
        elif isinstance(msg, RequestRejected):
            stream = self._streams.remove_wire(msg.req_id)
            if stream is not None:
                self._left_waiting(stream)
                stream.queue.put_nowait((stream.req_id, msg))
        elif isinstance(msg, EngineStats):
            self.stats = msg
            self.stats_received = time.monotonic()
            self.sent_since_stats = 0
            self.stats_gen += 1
            if self._on_stats is not None:
                self._on_stats(msg)
        elif isinstance(msg, EngineHealth):
            before = self.ready()
            if msg.incarnation and msg.incarnation != self.incarnation:
                if self.incarnation and self._streams.live:
                    # a new scheduler process; the one that held our live requests is gone
                    self._hold_all(CAUSE_NEW_INCARNATION, "the scheduler restarted (new incarnation)")
                self.incarnation = msg.incarnation
            self.health = msg
            if self._on_health is not None:
                self._on_health(msg)
            if self.ready() != before:
                log.info("scheduler readiness changed", extra={"ready": self.ready(), "reason": self.readiness()[1]})
            self._maybe_resume()

    def default_queue_timeout_s(self) -> float | None:
        """The scheduler's ``queue_timeout_s`` as last reported (None: not known)."""
        try:
            return float(self.stats.config["queue_timeout_s"]) if self.stats is not None else None
        except (KeyError, ValueError):
            return None

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            self.last_seen = time.monotonic()
            if not self.connected:  # a message proves the connection even if the monitor lags
                self._on_connected()
            try:
                msg = to_gateway_decoder.decode(frames[-1])
            except msgspec.DecodeError as e:
                log.warning("undecodable message from the scheduler", extra={"error": str(e)})
                continue
            try:
                self._dispatch(msg)
            except Exception:  # a metrics hook must never stop the receive loop
                log.exception("handling a scheduler message failed")

    async def _monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._on_connected()
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self._mark_down("connection lost", drop_health=True, cause=CAUSE_CONNECTION_LOST)
        finally:
            monitor.close(linger=0)

    async def _heartbeat_loop(self) -> None:
        tick = min(self.heartbeat_interval_s, 0.5)
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self._send(GatewayHeartbeat(gateway_id=self.gateway_id, time=time.time()))
                next_beat = now + self.heartbeat_interval_s
            if self.connected and self.last_seen is not None and now - self.last_seen > self.scheduler_timeout_s:
                # hung, not gone: if it speaks again, its last health report still holds
                self._mark_down(f"silent for {now - self.last_seen:.1f}s", drop_health=False, cause=CAUSE_SILENT)
            self._expire_held(now)
            await asyncio.sleep(tick)
