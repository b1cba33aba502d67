"""The scheduler process around the scheduling core: sockets, the worker handshake,
the step loop, and liveness of workers and gateways.

Sockets (endpoints are configuration):

- ROUTER bound at ``gateway_endpoint``: every gateway is a DEALER whose routing id
  is its ``gateway_id``, so several gateways share one engine;
- PUB bound at ``plan_endpoint``: one ``StepPlan`` reaches every worker rank;
- PULL bound at ``result_endpoint``: ``WorkerReady``, ``StepResult``,
  ``WorkerHeartbeat`` and ``WorkerError`` from every rank.

Start-up is a handshake, not a sleep: the core is built once every rank has sent
``WorkerReady`` (its KV block count is the smallest any rank reports). Requests that
arrive earlier wait in a bounded list and gateways hear ``scheduler_ready=False``.

Faults: a ready worker that stops heartbeating, misses ``step_timeout_s``, reports a
fatal ``WorkerError`` or re-announces with a new pid is dead. The scheduler then
abandons the step in flight, calls ``preempt_all()`` (every running request is
recomputed later from its prompt plus the tokens it already generated) and waits
for that rank's next ``WorkerReady`` (tensor parallel: every rank's, the group restarts
as one, ranks.py); clients only see a delay. A rank declared dead
that keeps heartbeating (a forward that overran ``step_timeout_s``) is sent
``Shutdown(rank=...)`` so that its supervisor restarts it with a clean state. A gateway silent for
``gateway_timeout_s`` has its requests aborted so their blocks come free.

The loop never spins: when there is no work it blocks in ``zmq.Poller.poll`` with a
timeout that wakes it for the next stats message or liveness check.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import psutil
import zmq

from services.scheduler.ranks import RankTable
from services.scheduler.reports import engine_health, engine_stats
from services.scheduler.scheduler import Scheduler
from shared.config import SchedulerConfig, config_as_dict
from shared.messages import (
    AbortRequest,
    AddRequest,
    EngineHealth,
    EngineStats,
    GatewayHeartbeat,
    RequestDeltas,
    RequestRejected,
    Shutdown,
    StepPlan,
    StepResult,
    ToScheduler,
    WorkerError,
    WorkerHeartbeat,
    WorkerReady,
    encode,
    from_worker_decoder,
    to_scheduler_decoder,
)
from shared.transport import bind

log = logging.getLogger("ferry.scheduler")

IDLE_POLL_S = 0.5  # longest sleep when idle: liveness checks need no finer clock
EMPTY_STEP_POLL_S = 0.02  # work exists but nothing could be scheduled (no blocks yet)
FALLBACK_MAX_MODEL_LEN = 2048
RETIRE_INTERVAL_S = 5.0  # how often a lingering dead worker is asked again to exit


@dataclass
class StepInFlight:
    plan: StepPlan
    deadline: float
    results: dict[int, StepResult] = field(default_factory=dict)
    t_start: float = 0.0  # perf_counter before schedule()
    t_sent: float = 0.0  # perf_counter after the plan was sent


class SchedulerService:
    """One engine replica's scheduler process. ``run()`` returns an exit code."""

    def __init__(
        self,
        config: SchedulerConfig,
        ctx: zmq.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.owns_ctx = ctx is None  # a context of our own is terminated on close (see close())
        self.ctx = ctx or zmq.Context()
        self.core: Scheduler | None = None
        self.ranks = RankTable(config.num_workers, config.block_size, config.worker_heartbeat_timeout_s)
        self.gateways: dict[str, float] = {}  # gateway_id -> last time heard from
        self.pending: list[tuple[AddRequest, float]] = []  # (request, deadline) before the handshake
        self.deferred: list[ToScheduler] = []  # gateway messages received during a step
        self.worker_restarts_total = 0
        self.retired: dict[int, float] = {}  # pid -> when it was last asked to exit
        self.max_model_len = config.max_model_len
        self.model = ""
        self.step: StepInFlight | None = None
        self.next_step: StepInFlight | None = None  # async scheduling: the plan sent ahead of ``step``'s result
        self.last_step_id = 0
        self.last_result_time: float | None = None  # perf_counter of the last result, while steps follow on
        self.flush = False
        self.core_num_kv_blocks = 0
        self.stop_requested = False
        self.stop_deadline = 0.0
        self.next_stats = 0.0
        self.process = psutil.Process()
        self.config_strings = {k: str(v) for k, v in config_as_dict(config).items()}
        self.gateway_sock = bind(self.ctx, zmq.ROUTER, config.gateway_endpoint, SNDHWM=100_000, RCVHWM=100_000)
        self.plan_sock = bind(self.ctx, zmq.PUB, config.plan_endpoint, SNDHWM=100_000)
        self.result_sock = bind(self.ctx, zmq.PULL, config.result_endpoint, RCVHWM=100_000)
        self.poller = zmq.Poller()
        self.poller.register(self.gateway_sock, zmq.POLLIN)
        self.poller.register(self.result_sock, zmq.POLLIN)

    # ------------------------------------------------------------------ lifecycle

    def request_stop(self) -> None:
        """Stop accepting new requests; in-flight ones get ``shutdown_grace_s`` to finish.

        Safe to call from a signal handler: it only sets two fields.
        """
        if not self.stop_requested:
            self.stop_requested = True
            self.stop_deadline = self.clock() + self.config.shutdown_grace_s

    def run(self) -> int:
        log.info("waiting for WorkerReady from %d rank(s)", self.config.num_workers)
        try:
            while not self._should_exit():
                self.run_once()
        finally:
            self.close()
        return 0

    def _should_exit(self) -> bool:
        if not self.stop_requested:
            return False
        if self.core is None or not self.core.has_unfinished_requests():
            return True
        return self.clock() >= self.stop_deadline

    def close(self) -> None:
        # Tell workers to exit so a restarted scheduler meets freshly announced ranks.
        self.plan_sock.send(encode(Shutdown(reason="scheduler stopping")))
        # Let the Shutdown leave. A PUB socket drops messages for peers that are gone at once,
        # so the linger only delays the exit while a connected worker has not read it yet; on
        # a starved machine 1 s was not always enough (a test saw no Shutdown in 20 s).
        self.plan_sock.close(linger=5000)
        self.gateway_sock.close(linger=0)
        self.result_sock.close(linger=0)
        # The linger only holds when the context is terminated: pyzmq skips that at interpreter
        # exit, and a process that exits first can take the queued Shutdown with it (CI saw a
        # drain end with no Shutdown sent in 20 s). term() waits up to the linger, no longer.
        if self.owns_ctx:
            self.ctx.term()

    def run_once(self) -> None:
        """One iteration: drain inputs, check liveness, run at most one step, report."""
        self._poll(0.0 if self._has_work() else self._idle_timeout())
        self._check_liveness()
        if self._has_work():
            scheduled = self._step()
            if not scheduled:
                self._poll(EMPTY_STEP_POLL_S)
        else:
            self.last_result_time = None  # the next step starts a fresh cycle, not an idle gap
        self._send_deltas()
        self._maybe_send_stats()

    def _has_work(self) -> bool:
        # ``flush`` asks for one more (possibly empty) plan after requests ended, so the
        # workers hear about finished and aborted ids even when nothing else runs.
        if not self.engine_ready() or self.core is None:
            return False
        return self.flush or self.core.has_unfinished_requests()

    def engine_ready(self) -> bool:
        return self.core is not None and self.ranks.all_ready()

    def _idle_timeout(self) -> float:
        return max(0.0, min(IDLE_POLL_S, self.next_stats - self.clock()))

    # ------------------------------------------------------------------ polling

    def _poll(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for input, then drain both sockets without blocking."""
        events = dict(self.poller.poll(int(timeout_s * 1000)))
        if not events:
            return
        self._drain_gateways()
        self._drain_workers()

    def _drain_gateways(self) -> None:
        while True:
            try:
                frames = self.gateway_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("dropping a gateway message with %d frames", len(frames))
                continue
            try:
                msg = to_scheduler_decoder.decode(frames[1])
            except msgspec.DecodeError as exc:
                log.warning("dropping an undecodable gateway message: %s", exc)
                continue
            self._touch_gateway(msg.gateway_id)
            if isinstance(msg, GatewayHeartbeat):
                continue
            if self.step is not None and not isinstance(msg, AddRequest):
                # Aborts wait for the step to end (the worker is computing those requests).
                # New requests join the waiting queue at once, so the waiting count and the
                # queue-full refusal see them while a long step runs.
                self.deferred.append(msg)
            else:
                self._handle_gateway(msg)

    def _touch_gateway(self, gateway_id: str) -> None:
        first_contact = gateway_id not in self.gateways
        self.gateways[gateway_id] = self.clock()
        if first_contact:
            log.info("gateway %s connected", gateway_id)
            if self.core is not None:
                self._send(gateway_id, self._stats())  # its /v1/config and metrics fill at once
            self._send(gateway_id, self._health())

    def _handle_gateway(self, msg: ToScheduler) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            ids = set(msg.req_ids)
            if self.core is not None:
                self.core.abort_requests(list(ids))
                self.flush = True
            self.pending = [p for p in self.pending if p[0].req_id not in ids]

    def _add(self, req: AddRequest) -> None:
        if self.stop_requested:
            self._reject(req, "shutting_down", "the engine is shutting down", None)
        elif self.core is not None:
            rejected = self.core.add_request(req)
            if rejected is not None:
                self._send(req.gateway_id, rejected)
        elif len(self.pending) >= self.config.max_waiting_requests:
            self._reject(
                req, "queue_full",
                f"the engine is starting and its waiting queue is full ({self.config.max_waiting_requests})",
                5.0,
            )
        else:
            timeout = req.queue_timeout_s if req.queue_timeout_s is not None else self.config.queue_timeout_s
            deadline = self.clock() + max(timeout, self.config.min_queue_timeout_s) if timeout > 0 else math.inf
            self.pending.append((req, deadline))

    def _reject(self, req: AddRequest, reason: str, message: str, retry_after_s: float | None) -> None:
        self._send(req.gateway_id, RequestRejected(req.req_id, reason, message, retry_after_s))

    def _drain_workers(self) -> None:
        while True:
            try:
                data = self.result_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = from_worker_decoder.decode(data)
            except msgspec.DecodeError as exc:
                log.warning("dropping an undecodable worker message: %s", exc)
                continue
            if not self.ranks.valid(msg.rank):
                log.error("message from rank %d, but this engine has %d rank(s)", msg.rank, len(self.ranks))
                continue
            if isinstance(msg, WorkerReady):
                self._on_ready(msg)
            elif isinstance(msg, WorkerHeartbeat):
                deaths, lingering = self.ranks.on_heartbeat(msg, self.clock())
                self._bury(deaths)
                if lingering:
                    self._retire(msg.rank, msg.pid)
            elif isinstance(msg, StepResult):
                self._on_result(msg)
            elif isinstance(msg, WorkerError):
                self._on_error(msg)

    # ------------------------------------------------------------------ workers

    def _on_ready(self, msg: WorkerReady) -> None:
        now = self.clock()
        deaths, accepted = self.ranks.on_ready(msg, now)
        self._bury(deaths)
        if not accepted:
            return
        self.ranks.accept(msg, now)
        log.info(
            "rank %d ready: pid %d, %d KV blocks, model %r, max_model_len %d",
            msg.rank, msg.pid, msg.num_kv_blocks, msg.model, msg.max_model_len,
        )
        if self.core is None and self.ranks.all_ready():
            self._build_core()
        elif self.core is not None and msg.num_kv_blocks < self.core_num_kv_blocks:
            log.error(
                "rank %d reports %d KV blocks, fewer than the %d in use: it must be given the same budget",
                msg.rank, msg.num_kv_blocks, self.core_num_kv_blocks,
            )
        if self.core is not None:
            self._broadcast(self._stats())  # numbers first, so a gateway that turns ready has them
        self._broadcast(self._health())

    def _build_core(self) -> None:
        infos = self.ranks.infos()
        num_kv_blocks = self.config.num_kv_blocks or min(i.num_kv_blocks for i in infos)
        if not self.max_model_len:
            lens = [i.max_model_len for i in infos if i.max_model_len > 0]
            self.max_model_len = min(lens) if lens else FALLBACK_MAX_MODEL_LEN
        self.max_model_len = self._fit_max_model_len(num_kv_blocks)
        self.model = infos[0].model
        self.core_num_kv_blocks = num_kv_blocks
        # a hybrid KV cache (every rank splits its budget by the same formula)
        window = infos[0].window
        num_window_blocks = min(i.num_window_blocks for i in infos) if window else 0
        self.core = Scheduler(self.config, num_kv_blocks, self.max_model_len, window=window,
                              num_window_blocks=num_window_blocks)
        # Start-up objects (modules, the core's structures) leave the GC's view, so full
        # collections walk only live request state; full collections are the source of
        # the step-time p99 (docs/benchmarks.md, "Scheduler step cost").
        gc.collect()
        gc.freeze()
        self.next_stats = 0.0  # gateways learn the engine's numbers right away
        log.info(
            "engine ready: %d KV blocks of %d tokens, max_model_len %d, %d request(s) queued during start-up%s",
            num_kv_blocks, self.config.block_size, self.max_model_len, len(self.pending),
            f"; windowed layers: {num_window_blocks} blocks for windows of {window}" if num_window_blocks else "",
        )
        pending, self.pending = self.pending, []
        for req, _ in pending:
            self._add(req)

    def _fit_max_model_len(self, num_kv_blocks: int) -> int:
        """``max_model_len``, capped to the tokens the KV cache holds.

        A sequence longer than the whole cache can never run, so a longer limit would
        only turn requests without ``max_tokens`` (whose default fills the context)
        into 400s. The cap is decided once, here, and reported everywhere the limit is
        (``/v1/models``, ``/v1/config``, the ready log line).
        """
        capacity = num_kv_blocks * self.config.block_size
        if self.max_model_len <= capacity:
            return self.max_model_len
        log.warning(
            "max_model_len %d is more than the KV cache holds (%d blocks of %d tokens = %d tokens): "
            "capped to %d; give the workers more KV memory (--kv-cache-memory, or --gpu-memory-utilization "
            "on a GPU) or pass a smaller --max-model-len to silence this",
            self.max_model_len, num_kv_blocks, self.config.block_size, capacity, capacity,
            extra={"max_model_len_asked": self.max_model_len, "kv_capacity_tokens": capacity},
        )
        return capacity

    def _on_result(self, msg: StepResult) -> None:
        counts = self.ranks.on_result(msg.rank, self.clock())
        for step in (self.step, self.next_step):
            if counts and step is not None and msg.step_id == step.plan.step_id:
                step.results[msg.rank] = msg
        # Anything else is a late answer to a step abandoned after a fault: ignore it.

    def _on_error(self, msg: WorkerError) -> None:
        log.error("rank %d reported an error (step %s, fatal=%s): %s", msg.rank, msg.step_id, msg.fatal, msg.message)
        if msg.fatal:
            self._bury([(msg.rank, "fatal worker error")])
        elif self.step is not None and self.core is not None:
            # The step failed but the process lives: recompute everything it held.
            self.step = self.next_step = None
            self.core.preempt_all()

    def _bury(self, deaths: list[tuple[int, str]]) -> None:
        """Declare ranks dead: abandon the step in flight and recompute every running request.

        A tensor-parallel rank takes its whole group down with it (ranks.py): every rank is
        declared dead here, at once, so the deaths noticed later in the same group restart are
        not news and the outage is one crash for the poison rule (poison.py), not one per rank.
        """
        for rank, reason in deaths:
            if not self.ranks.mark_dead(rank):
                continue
            self.worker_restarts_total += 1
            log.warning("rank %d (pid %d) is dead: %s; waiting for it to announce itself again",
                        rank, self.ranks.pid(rank), reason)
            if self.ranks.group_restarts():
                for other in self.ranks.ready_ranks():
                    self.ranks.mark_dead(other)
                    self.worker_restarts_total += 1
                    log.warning("rank %d (pid %d) goes down with its tensor-parallel group (rank %d died); "
                                "waiting for a new process to announce itself", other, self.ranks.pid(other), rank)
            if self.core is not None:
                self.step = self.next_step = None
                self.core.preempt_all()
            self._broadcast(self._health())

    def _retire(self, rank: int, pid: int) -> None:
        """Ask a worker we cannot use (declared dead, or announced to a previous scheduler
        process) but which still runs to exit, so that its supervisor restarts it."""
        now = self.clock()
        if now - self.retired.get(pid, -math.inf) < RETIRE_INTERVAL_S:
            return
        self.retired[pid] = now
        log.warning("rank %d (pid %d) runs but is not usable by this scheduler: asking it to exit", rank, pid)
        # pid: a new process of the same rank (a group restart under way) must not take this for itself
        self.plan_sock.send(encode(Shutdown(reason=f"rank {rank} (pid {pid}) was declared dead", rank=rank, pid=pid)))

    def _check_liveness(self) -> None:
        now = self.clock()
        if self.pending:
            self._expire_pending(now)
        self._bury(self.ranks.silent(now))
        for gateway_id, last_seen in list(self.gateways.items()):
            if now - last_seen > self.config.gateway_timeout_s:
                del self.gateways[gateway_id]
                num = self.core.abort_gateway(gateway_id) if self.core is not None else 0
                self.flush = True
                num += sum(1 for r, _ in self.pending if r.gateway_id == gateway_id)
                self.pending = [p for p in self.pending if p[0].gateway_id != gateway_id]
                log.warning("gateway %s silent for %.1fs: aborted its %d request(s)", gateway_id, now - last_seen, num)

    def _expire_pending(self, now: float) -> None:
        """Requests queued before the workers were up end like any queue timeout."""
        keep = []
        for req, deadline in self.pending:
            if deadline <= now:
                self._reject(req, "timeout", "the engine did not become ready within the request's queue timeout",
                             None)
            else:
                keep.append((req, deadline))
        self.pending = keep

    # ------------------------------------------------------------------ stepping

    def _step(self) -> bool:
        """Complete one step (scheduling it, and with async scheduling the next one too,
        first). Returns False if nothing ran."""
        assert self.core is not None
        self.flush = False
        if self.step is None:
            self.step = self._schedule_and_send()
            if self.step is None:
                self.last_result_time = None
                return False
        if self.config.async_scheduling and self.next_step is None and self.core.has_unfinished_requests():
            # Plan N+1 now, while the workers compute N: it assumes each request sampling in
            # N gets one token; one that stops there has its N+1 token discarded.
            self.next_step = self._schedule_and_send()
        step = self.step
        result = self._wait_for_results()
        t_result = time.perf_counter()
        self.step, self.next_step = self.next_step, None
        if result is not None:
            self.core.update_from_result(step.plan, result)
            self.flush = True  # requests may have finished: the next plan tells the workers
            self._record_phases(step.t_start, step.t_sent, t_result, result)
            if self.step is not None:
                self.step.deadline = self.clock() + self.config.step_timeout_s  # it runs from now
        else:
            self.last_result_time = None
        deferred, self.deferred = self.deferred, []
        for msg in deferred:
            self._handle_gateway(msg)
        return True

    def _schedule_and_send(self) -> StepInFlight | None:
        """Schedule one plan and publish it; None when it has no tokens to run."""
        assert self.core is not None
        t_start = time.perf_counter()
        plan = self.core.schedule()
        self.last_step_id = plan.step_id
        if plan.total_num_scheduled_tokens == 0:
            if plan.finished_req_ids or plan.preempted_req_ids:
                self.plan_sock.send(encode(plan))  # workers must still drop those requests
            self.core.update_from_result(plan, StepResult(step_id=plan.step_id, rank=0))
            return None
        self.plan_sock.send(encode(plan))
        return StepInFlight(plan, self.clock() + self.config.step_timeout_s, t_start=t_start,
                            t_sent=time.perf_counter())

    def _record_phases(self, t_start: float, t_sent: float, t_result: float, result: StepResult) -> None:
        """Split one step cycle into schedule, forward, sample and idle (EngineStats.step_*_s).

        The cycle runs from the previous step's result (when steps follow each other)
        or from this step's schedule() to this result; idle is what the worker's
        forward and sample leave of it."""
        assert self.core is not None
        cycle_start = self.last_result_time if self.last_result_time is not None else t_start
        busy = result.forward_s + result.sample_s
        idle = max(0.0, (t_result - cycle_start) - busy)
        self.core.counters.record_step_phases(t_sent - t_start, result.forward_s, result.sample_s, idle)
        self.last_result_time = t_result

    def _wait_for_results(self) -> StepResult | None:
        """Block (in poll, never spinning) until every rank answered; None if the step was lost."""
        while True:
            step = self.step
            if step is None:
                return None  # a rank died and the step was abandoned
            missing = [r for r in range(len(self.ranks)) if r not in step.results]
            if not missing:
                return step.results[0]
            now = self.clock()
            if now >= step.deadline:
                timeout = self.config.step_timeout_s
                self._bury([(rank, f"no result for step {step.plan.step_id} in {timeout}s") for rank in missing])
                return None
            self._poll(min(IDLE_POLL_S, step.deadline - now))
            self._check_liveness()
            self._maybe_send_stats()

    # ------------------------------------------------------------------ output

    def _send(self, gateway_id: str, msg: msgspec.Struct) -> None:
        # Unknown or gone routing ids are dropped by the ROUTER, which is what we want.
        self.gateway_sock.send_multipart([gateway_id.encode(), encode(msg)])

    def _broadcast(self, msg: msgspec.Struct) -> None:
        if not self.gateways:
            return
        data = encode(msg)  # once, not once per gateway
        for gateway_id in self.gateways:
            self.gateway_sock.send_multipart([gateway_id.encode(), data])

    def _send_deltas(self) -> None:
        if self.core is None:
            return
        step_id = self.last_step_id
        for gateway_id, deltas in self.core.take_deltas().items():
            if deltas:
                self._send(gateway_id, RequestDeltas(step_id=step_id, deltas=deltas))

    def _maybe_send_stats(self) -> None:
        now = self.clock()
        if now < self.next_stats:
            return
        self.next_stats = now + self.config.stats_interval_s
        if self.gateways:
            self._broadcast(self._health())
            if self.core is not None:
                self._broadcast(self._stats())

    def _health(self) -> EngineHealth:
        return engine_health(
            self.ranks, ready=self.engine_ready(), stopping=self.stop_requested, model=self.model,
            max_model_len=self.max_model_len, block_size=self.config.block_size, config=self._typed_config(),
        )

    def _typed_config(self) -> dict[str, int | float | bool | str]:
        """The effective knobs with their types (for /v1/config), plus what start-up decided."""
        values: dict[str, int | float | bool | str] = dict(config_as_dict(self.config))
        if self.core is not None:
            values.update(num_kv_blocks=self.core_num_kv_blocks, max_model_len=self.max_model_len)
        return values

    def _stats(self) -> EngineStats:
        assert self.core is not None
        return engine_stats(self.core.stats(), self.ranks, self.process, self.worker_restarts_total,
                            self.config_strings)
