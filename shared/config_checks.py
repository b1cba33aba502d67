"""Range and choice checks for every service config, run at the edge before anything starts.

``config_errors(config)`` returns one line per bad knob, named by its flag
(``--max-num-seqs must be at least 1 (got 0)``), so ``ferry serve`` can refuse a
bad command line before it starts Redis or any child, and each service's own
``python -m`` entry can refuse it the same way. Exit code 2, like argparse.

The rules are keyed by field name, not by config class: a knob that several
configs share (``block_size``, ``max_num_seqs``) is checked once, the same way,
wherever it appears, and a field this table does not know yet passes (new knobs
opt in by adding a rule here).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

Rule = Callable[[Any], str | None]


def at_least(low: float) -> Rule:
    def check(value: Any) -> str | None:
        return None if value >= low else f"must be at least {low:g} (got {value!r})"
    return check


def positive(value: Any) -> str | None:
    ok = value > 0 and (not isinstance(value, float) or math.isfinite(value))
    return None if ok else f"must be greater than 0 (got {value!r})"


def between(low: float, high: float) -> Rule:
    def check(value: Any) -> str | None:
        return None if low <= value <= high else f"must be between {low:g} and {high:g} (got {value!r})"
    return check


def one_of(*choices: str) -> Rule:
    def check(value: Any) -> str | None:
        if value in choices:
            return None
        shown = ", ".join(repr(c) for c in choices)
        return f"must be one of {shown} (got {value!r})"
    return check


def endpoint(value: Any) -> str | None:
    ok = isinstance(value, str) and value.startswith(("ipc://", "tcp://", "inproc://"))
    return None if ok else f"must be a ZeroMQ endpoint such as ipc:///tmp/ferry/x.sock or tcp://host:port (got {value!r})"


def power_of_two(value: Any) -> str | None:
    ok = isinstance(value, int) and value >= 1 and value & (value - 1) == 0
    return None if ok else f"must be a power of two such as 16 (got {value!r})"


def device(value: Any) -> str | None:
    ok = value == "cpu" or value == "cuda" or (isinstance(value, str) and value.startswith("cuda:")
                                                and value[5:].isdigit())
    return None if ok else f"must be 'cpu', 'cuda' or 'cuda:N' (got {value!r})"


def non_empty(value: Any) -> str | None:
    return None if value else "must not be empty"


def proxies(value: Any) -> str | None:
    """IP addresses or networks separated by commas, or '*' (uvicorn's --forwarded-allow-ips)."""
    for item in str(value).split(","):
        item = item.strip()
        if item and item != "*":
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                return f"must be IP addresses or networks separated by commas, or '*' (got {item!r})"
    return None


RULES: dict[str, list[Rule]] = {
    # scheduler (and the worker's copies of the same knobs)
    "max_num_batched_tokens": [at_least(1)],
    "max_num_seqs": [at_least(1)],
    "long_prefill_token_threshold": [at_least(0)],
    "block_size": [power_of_two],
    "max_model_len": [at_least(0)],
    "scheduling_policy": [one_of("fcfs", "priority")],
    "max_waiting_requests": [at_least(1)],
    "max_waiting_tokens": [at_least(0)],
    "queue_timeout_s": [positive],
    "min_queue_timeout_s": [at_least(0)],
    "num_kv_blocks": [at_least(0)],
    "num_workers": [at_least(1)],
    "gateway_endpoint": [endpoint],
    "plan_endpoint": [endpoint],
    "result_endpoint": [endpoint],
    "scheduler_endpoint": [endpoint],
    "step_timeout_s": [positive],
    "gateway_timeout_s": [positive],
    "stats_interval_s": [positive],
    "worker_heartbeat_timeout_s": [positive],
    "shutdown_grace_s": [at_least(0)],
    # worker
    "model": [non_empty],
    "dtype": [one_of("auto", "bfloat16", "float32", "float16")],
    "device": [device],
    "kv_cache_memory": [positive],
    "gpu_memory_utilization": [between(0.05, 1.0)],
    "num_threads": [at_least(0)],
    "rank": [at_least(0)],
    "quantization": [one_of("none", "int8")],
    "tensor_parallel_size": [at_least(1)],
    # gateway
    "port": [between(1, 65535)],
    "host": [non_empty],
    "max_body_bytes": [at_least(1024)],
    "max_n": [at_least(1)],
    "metrics_compat": [one_of("", "vllm")],
    "heartbeat_interval_s": [positive],
    "default_rpm": [at_least(0)],
    "scheduler_timeout_s": [positive],
    "redis_timeout_s": [positive],
    "max_inflight_requests": [at_least(0)],
    "auth_failure_limit": [at_least(0)],
    "auth_failure_block_s": [positive],
    "forwarded_allow_ips": [proxies],
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def config_errors(config: msgspec.Struct) -> list[str]:
    """One line per knob of ``config`` out of range, plus the checks that relate two knobs."""
    errors: list[str] = []
    for name in config.__struct_fields__:
        value = getattr(config, name)
        for rule in RULES.get(name, ()):
            message = rule(value)
            if message is not None:
                errors.append(f"{flag(name)} {message}")
                break
    errors += _relations(config)
    return errors


def _relations(config: msgspec.Struct) -> list[str]:
    """Checks across two fields of one config (each field alone is in range)."""
    errors: list[str] = []
    get = lambda name: getattr(config, name, None)  # noqa: E731 - a local shorthand
    if get("dtype") == "float16" and get("device") == "cpu":
        errors.append("--dtype float16 is refused on a CPU: CPUs have no fast float16 matrix arithmetic "
                      "(torch falls back to slow paths); use --dtype bfloat16 (native on CPUs with AVX-512 "
                      "BF16 or AMX) or float32, or 'auto' to pick between them")
    if get("quantization") == "int8":
        if get("device") not in (None, "cpu"):
            errors.append("--quantization int8 runs on the CPU only (PyTorch's int8 matmul, torch._int_mm)")
        if (get("tensor_parallel_size") or 1) > 1:
            errors.append("--quantization int8 cannot be combined with --tensor-parallel-size above 1 "
                          "(the split works on plain linear layers)")
    queue, floor = get("queue_timeout_s"), get("min_queue_timeout_s")
    if isinstance(queue, float) and isinstance(floor, float) and floor > queue > 0:
        errors.append(f"--min-queue-timeout-s ({floor:g}) must not exceed --queue-timeout-s ({queue:g})")
    rank, workers = get("rank"), get("num_workers")
    if isinstance(rank, int) and isinstance(workers, int) and workers >= 1 and rank >= workers:
        errors.append(f"--rank ({rank}) must be below --num-workers ({workers})")
    return errors


def model_error(name: str) -> str | None:
    """Whether ``--model`` names something loadable (a local folder, a .gguf, a built-in name)."""
    from shared.models import ModelNotFoundError, resolve_model

    try:
        resolve_model(name)
    except ModelNotFoundError as exc:
        message = str(exc)
        return "--" + message if message.startswith("model ") else f"--model: {message}"
    return None


def runtime_dir_error(path: str) -> str | None:
    if not path:
        return None
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--runtime-dir {path!r} exists and is not a folder"
    # a unix socket path is limited to ~107 bytes; the longest ferry puts there is "gateway.sock"
    longest = len(os.path.join(os.path.abspath(path), "gateway.sock"))
    if longest > 107:
        return f"--runtime-dir {path!r} is too long for unix sockets ({longest} of at most 107 bytes with the socket name)"
    return None


def all_errors(configs: Iterable[msgspec.Struct]) -> list[str]:
    """Errors of several configs, each line once (a knob shared by two configs is reported once)."""
    seen: dict[str, None] = {}
    for config in configs:
        for line in config_errors(config):
            seen.setdefault(line, None)
    return list(seen)


def exit_on_errors(prog: str, errors: list[str]) -> None:
    """Print ``prog: error: LINE`` per error and exit 2, or return when there are none."""
    if not errors:
        return None
    for line in errors:
        print(f"{prog}: error: {line}", file=sys.stderr)
    sys.exit(2)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` that shows every option's default (argparse's own formatter shows none,
    and ``ArgumentDefaultsHelpFormatter`` repeats ones the text already states)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or action.required or "default" in text or default is argparse.SUPPRESS
                or isinstance(action, argparse._HelpAction)  # noqa: SLF001 - argparse has no public type for it
                or (default is False and action.nargs == 0)):
            return text
        if default is None or default == []:
            shown = "none"
        elif isinstance(default, str):
            shown = repr(default)
        else:
            shown = str(default)
        return f"{text} [default: {shown.replace('%', '%%')}]"
