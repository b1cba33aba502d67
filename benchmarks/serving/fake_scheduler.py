"""A stand-in scheduler for the gateway's tests and benchmark (never used when serving).

``FakeScheduler`` binds a real zmq ROUTER (in a thread) and speaks the scheduler's
side of the gateway protocol: it answers a new gateway with ``EngineHealth``,
sends ``EngineStats`` and health every 0.1 s, and answers each ``AddRequest`` with
one deterministic token per tick (the ``script`` rotated by the request's seed)
until ``max_tokens`` (finish ``length``) or ``eos_after`` (finish ``stop``). It
records adds, aborts and heartbeats, and can refuse (``reject``), hold requests
in a queue (``hold``), finish them at once with a reason (``finish_now``, or
``finish_running`` for those already accepted), or go
silent (``mute``) on demand.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import zmq

from shared.messages import (
    AbortRequest,
    AddRequest,
    EngineHealth,
    EngineStats,
    GatewayHeartbeat,
    RequestDelta,
    RequestDeltas,
    RequestRejected,
    RequestTimings,
    SampleLogprobs,
    TokenLogprob,
    encode,
    to_scheduler_decoder,
)


class FakeScheduler:
    """The scheduler's half of the gateway protocol, with scripted behaviour."""

    def __init__(self, endpoint: str, script: list[int], eos_id: int = 2, tick_s: float = 0.01,
                 max_model_len: int = 256) -> None:
        self.endpoint = endpoint
        self.max_model_len = max_model_len
        self.script = script
        self.eos_id = eos_id
        self.tick_s = tick_s
        self.adds: list[AddRequest] = []
        self.aborts: list[str] = []
        self.heartbeats: list[GatewayHeartbeat] = []
        self.reject: tuple[str, float | None] | None = None  # (reason, retry_after_s) for new adds
        self.hold = False  # accept but never generate (a long queue wait)
        self.finish_now: str | None = None  # finish new requests at once with this reason
        self.finish_running: str | None = None  # finish every accepted request (held too) with this reason, once
        self.eos_after: int | None = None  # emit EOS as the N-th token (finish "stop")
        self.cached_tokens = 0
        self.mute = False  # alive but silent (a hung scheduler): sends nothing at all
        self.workers_ready = [0]
        self.num_waiting = 0  # reported in EngineStats (the gateway's early queue_full check reads it)
        self.drain_rate_rps = 2.0
        self.stats_config = {"max_num_seqs": "4", "max_waiting_requests": "1024"}
        self.incarnation = uuid.uuid4().hex[:12]  # a new "process" per instance
        self.lock = threading.Lock()
        self._running: dict[str, dict[str, Any]] = {}
        self._gateways: set[bytes] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()

    def tokens_for(self, add: AddRequest) -> list[int]:
        """The deterministic output of ``add`` (rotated by its seed), ignoring EOS."""
        shift = (add.sampling.seed or 0) % len(self.script)
        rotated = self.script[shift:] + self.script[:shift]
        return [rotated[i % len(rotated)] for i in range(add.stop.max_tokens)]

    def aborted(self) -> set[str]:
        with self.lock:
            return set(self.aborts)

    # -- loop --------------------------------------------------------------------

    def _send(self, gw: bytes, msg: Any) -> None:
        if not self.mute:
            self._sock.send_multipart([gw, encode(msg)])

    def _health(self) -> EngineHealth:
        return EngineHealth(time=time.time(), scheduler_ready=True, num_workers=1,
                            workers_ready=list(self.workers_ready), model="tiny",
                            max_model_len=self.max_model_len, block_size=16, detail="fake",
                            incarnation=self.incarnation)

    def _run(self) -> None:
        next_stats = 0.0
        while not self._stop.is_set():
            if self._sock.poll(int(self.tick_s * 1000)):
                while True:
                    try:
                        gw, payload = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(gw, to_scheduler_decoder.decode(payload))
            self._step()
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + 0.1
                for gw in self._gateways:
                    self._send(gw, self._health())
                    self._send(gw, EngineStats(time=time.time(), num_running=len(self._running),
                                               num_waiting=self.num_waiting, num_kv_blocks_total=64,
                                               num_kv_blocks_free=64, kv_usage=0.0, drain_rate_rps=self.drain_rate_rps,
                                               config=dict(self.stats_config)))

    def _on_message(self, gw: bytes, msg: Any) -> None:
        if gw not in self._gateways:
            self._gateways.add(gw)
            self._send(gw, self._health())
        with self.lock:
            if isinstance(msg, GatewayHeartbeat):
                self.heartbeats.append(msg)
            elif isinstance(msg, AbortRequest):
                self.aborts.extend(msg.req_ids)
                for rid in msg.req_ids:
                    self._running.pop(rid, None)
            elif isinstance(msg, AddRequest):
                self.adds.append(msg)
                self._on_add(gw, msg)

    def _on_add(self, gw: bytes, add: AddRequest) -> None:
        if self.reject is not None:
            reason, retry = self.reject
            self._send(gw, RequestRejected(add.req_id, reason, f"refused: {reason}", retry))
            return
        if self.finish_now is not None:
            self._send(gw, RequestDeltas(0, [RequestDelta(add.req_id, finish_reason=self.finish_now,
                                                          error=f"fake {self.finish_now}")]))
            return
        # a continuation picks the script up where the tokens it already streamed end
        self._running[add.req_id] = {"gw": gw, "add": add, "tokens": self.tokens_for(add),
                                     "pos": len(add.output_token_ids)}

    def _step(self) -> None:
        if self.finish_running is not None:
            reason, self.finish_running = self.finish_running, None
            with self.lock:
                ended, self._running = self._running, {}
            for rid, r in ended.items():
                self._send(r["gw"], RequestDeltas(0, [RequestDelta(rid, finish_reason=reason, error=f"fake {reason}")]))
        if self.hold:
            return
        out: dict[bytes, list[RequestDelta]] = {}
        with self.lock:
            for rid, r in list(self._running.items()):
                out.setdefault(r["gw"], []).append(self._advance(rid, r))
        for gw, deltas in out.items():
            self._send(gw, RequestDeltas(0, deltas))

    def _advance(self, rid: str, r: dict[str, Any]) -> RequestDelta:
        add: AddRequest = r["add"]
        pos = r["pos"]
        tid = r["tokens"][pos]
        finish = None
        if self.eos_after is not None and pos + 1 == self.eos_after and not add.stop.ignore_eos:
            tid, finish = self.eos_id, "stop"
        r["pos"] = pos + 1
        if finish is None and r["pos"] >= add.stop.max_tokens:
            finish = "length"
        if finish is not None:
            del self._running[rid]
        lps = None
        if add.sampling.logprobs is not None:
            top = [TokenLogprob(tid, -0.25)] + [TokenLogprob(t, -2.0 - t / 1000) for t in range(3, 3 + 19)]
            lps = [SampleLogprobs(TokenLogprob(tid, -0.25), top[:add.sampling.logprobs])]
        now = time.time()
        first = r.setdefault("first_token_time", now)
        timings = RequestTimings(arrival_time=add.arrival_time, first_scheduled_time=add.arrival_time,
                                 first_token_time=first, finished_time=now if finish else None)
        return RequestDelta(rid, [tid], lps, finish, stop_token_id=tid if finish == "stop" else None,
                            num_prompt_tokens=len(add.prompt_token_ids), num_cached_tokens=self.cached_tokens,
                            timings=timings if pos == len(add.output_token_ids) or finish else None)
