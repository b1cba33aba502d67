"""The worker process: receive step plans, run them, send results back.

Start-up order matters: the SUB socket for plans connects *before* the slow
model load, so the subscription is in place long before the scheduler's first
plan (ZeroMQ's slow-joiner problem would otherwise drop it). Then the model
loads, ``WorkerReady`` goes out, and a side thread with its own PUSH socket
sends a ``WorkerHeartbeat`` every second, also while a long forward runs.

Exit codes: 0 after a ``Shutdown`` (or when the parent process is gone), 1 when
loading or a step fails (a ``WorkerError`` with ``fatal=True`` is sent first).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import threading
import time
import traceback
from typing import TYPE_CHECKING

import msgspec
import psutil
import zmq

from shared.config import WorkerConfig, add_config_args, config_as_dict, config_from_args
from shared.config_checks import config_errors, exit_on_errors
from shared.logs import add_logging_args, setup_logging_from_args
from shared.messages import (
    Shutdown,
    StepPlan,
    WorkerError,
    WorkerHeartbeat,
    WorkerReady,
    encode,
    to_worker_decoder,
)
from shared.models import resolve_model
from shared.transport import connect

from .memory import (
    keep_freed_memory,
    keep_out_unused_modules,
    log_ready_memory,
    release_and_log,
    release_freed_memory,
)

if TYPE_CHECKING:
    from .runner import ModelRunner

log = logging.getLogger("ferry.worker")

HEARTBEAT_INTERVAL_S = 1.0
POLL_MS = 1000  # how often an idle worker checks that its parent is still alive
SEND_LINGER_MS = 2000  # let the last message (error, ready) leave before the process exits


def _heartbeat(config: WorkerConfig, ctx: zmq.Context, stop: threading.Event) -> None:
    sock = connect(ctx, zmq.PUSH, config.result_endpoint)
    proc = psutil.Process()
    cuda = config.device.startswith("cuda")
    if cuda:
        import torch
    try:
        while not stop.wait(HEARTBEAT_INTERVAL_S):
            beat = WorkerHeartbeat(
                rank=config.rank,
                pid=os.getpid(),
                time=time.time(),
                rss_bytes=proc.memory_info().rss,
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                device_memory_peak_bytes=torch.cuda.max_memory_allocated() if cuda else 0,
            )
            sock.send(encode(beat))
    finally:
        sock.close()


def _fail(sock: zmq.Socket, config: WorkerConfig, message: str, step_id: int | None) -> int:
    log.error("fatal: %s", message)
    sock.send(encode(WorkerError(rank=config.rank, message=message[-4000:], step_id=step_id, fatal=True)))
    sock.close(linger=SEND_LINGER_MS)
    return 1


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def serve(config: WorkerConfig) -> int:
    log.info("worker config: %s", config_as_dict(config))
    ctx = zmq.Context()
    try:
        return _serve(config, ctx)
    finally:
        # Terminating the context is what makes a closing socket's linger hold (pyzmq skips
        # it at interpreter exit): a fatal WorkerError queued just before is sent, not lost.
        ctx.destroy()


def _serve(config: WorkerConfig, ctx: zmq.Context) -> int:
    plans = connect(ctx, zmq.SUB, config.plan_endpoint, SUBSCRIBE=b"")
    results = connect(ctx, zmq.PUSH, config.result_endpoint)
    parent = os.getppid()
    keep_out_unused_modules(config.device)  # before transformers imports torch._dynamo (memory.py)
    try:
        resolve_model(config.model)  # a bad name fails before the slow torch import
        from .runner import ModelRunner, set_num_threads

        log.info("torch threads: %d", set_num_threads(config.num_threads))
        runner = ModelRunner(config)
    except Exception as exc:  # noqa: BLE001 - any load failure is reported, then fatal
        return _fail(results, config, f"load failed: {exc!r}", None)
    log_ready_memory(runner.model, runner.kv.caches, release_freed_memory())  # what loading freed, back
    # From here on, freed step buffers stay in the heap for the next step (shared/heap.py).
    log.info("step buffers kept for reuse: %s", "yes" if keep_freed_memory() else "no (glibc defaults)")
    # The grammar tokenizer loads in a side thread, often past this point: trim its leftovers too.
    runner.constraints.when_tokenizer_loaded(lambda: release_and_log("grammar tokenizer loaded", log))
    log.info(
        "ready: %s in %.1fs, %d KV blocks of %d (%d bytes, %s), weights %d bytes, dtype %s",
        runner.model_dir, runner.load_s, runner.num_kv_blocks, runner.block_size,
        runner.kv_cache_bytes, runner.kv_dtype, runner.weight_bytes, runner.dtype,
    )
    results.send(encode(WorkerReady(
        rank=config.rank, num_kv_blocks=runner.num_kv_blocks, block_size=runner.block_size,
        model=runner.model_name, max_model_len=runner.max_model_len, vocab_size=runner.vocab_size,
        pid=os.getpid(), kv_cache_bytes=runner.kv_cache_bytes, weight_bytes=runner.weight_bytes,
        dtype=str(runner.dtype).removeprefix("torch."), device=str(runner.device), num_threads=_torch_threads(),
        tensor_parallel_size=config.tensor_parallel_size,
        window=runner.hybrid_kv.window if runner.hybrid_kv else 0,
        num_window_blocks=runner.hybrid_kv.num_window_blocks if runner.hybrid_kv else 0,
    )))
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(config, ctx, stop), name="heartbeat", daemon=True)
    beat.start()
    try:
        return _loop(runner, plans, results, config, parent)
    finally:
        stop.set()
        beat.join(timeout=2 * HEARTBEAT_INTERVAL_S)


def _loop(runner: ModelRunner, plans: zmq.Socket, results: zmq.Socket, config: WorkerConfig, parent: int) -> int:
    while True:
        if not plans.poll(POLL_MS):
            if os.getppid() != parent:
                log.warning("parent process %d is gone; exiting", parent)
                return 0
            continue
        try:
            msg = to_worker_decoder.decode(plans.recv())
        except msgspec.DecodeError as exc:
            return _fail(results, config, f"undecodable message: {exc}", None)
        if isinstance(msg, Shutdown):
            if msg.rank is not None and (msg.rank != config.rank or msg.pid not in (0, os.getpid())):
                continue  # another rank, or this rank's previous process, is being retired
            log.info("shutdown: %s", msg.reason or "requested")
            results.close(linger=SEND_LINGER_MS)
            return 0
        assert isinstance(msg, StepPlan)
        try:
            result = runner.execute(msg)
        except Exception:  # noqa: BLE001 - a failed step is fatal for this worker
            return _fail(results, config, f"step {msg.step_id} failed:\n{traceback.format_exc()}", msg.step_id)
        results.send(encode(result))


def build_parser() -> argparse.ArgumentParser:
    """The worker's flags (also imported by tests/unit/deploy/test_compose.py to check docker-compose.yml)."""
    parser = argparse.ArgumentParser(prog="python -m services.worker", description="a ferry model worker rank")
    add_config_args(parser, WorkerConfig)
    add_logging_args(parser)
    return parser


OPENMP_SPIN_COUNT = "10000"  # ferry_cli/serve.py gives its workers the same default


def default_openmp_wait_policy(environ: dict[str, str] | os._Environ[str]) -> None:
    """OpenMP threads that spin briefly at barriers, then sleep, unless the operator chose a policy.

    libgomp's default spin (300,000 rounds) burns the core a straggling sibling thread
    needs whenever anything else runs (gateway, scheduler, clients, other jobs): 2-thread
    matmuls ran 10-30x slower on a shared 2-core machine. Never spinning
    (``OMP_WAIT_POLICY=PASSIVE``) fixed that but cost ~20 % of a quiet machine's
    throughput, because every one of a step's ~1,000 parallel regions then woke its
    threads through the kernel. ``GOMP_SPINCOUNT=10000`` keeps the threads awake across
    the microseconds between one op and the next and asleep between steps
    (docs/benchmarks.md, "Threads: ferry's pool and OpenMP waits"). libgomp reads this when
    torch loads, so it is set before that.
    """
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT


def main(argv: list[str] | None = None) -> int:
    default_openmp_wait_policy(os.environ)  # every way of starting a worker (serve, compose, k8s)
    args = build_parser().parse_args(argv)
    config = config_from_args(WorkerConfig, args)
    exit_on_errors(f"ferry worker{config.rank}", config_errors(config))
    # The same structured logs as the gateway and scheduler, one service name per rank.
    setup_logging_from_args(f"worker{config.rank}", args)
    return serve(config)
