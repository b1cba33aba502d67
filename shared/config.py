"""Typed, frozen configuration for every ferry service, built once at the edge.

Each service has one ``msgspec.Struct`` config. ``add_config_args`` turns its
fields into command-line flags (the field name with dashes: ``--max-num-seqs``)
whose defaults come from ``FERRY_<FIELD>`` environment variables, and
``config_from_args`` builds the frozen object. Nothing in the core reads the
environment; it receives one of these objects.

The scheduler's knobs keep vLLM's names so operators can carry runbooks over.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from typing import Any, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)

DEFAULT_RUNTIME_DIR = "/tmp/ferry"


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The step loop's knobs (vLLM names) plus admission knobs vLLM lacks."""

    max_num_batched_tokens: int = 2048
    """Tokens processed in one step, prefill chunks and decodes together."""
    max_num_seqs: int = 128
    """Requests in the running set at once."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the step's remaining budget across steps."""
    long_prefill_token_threshold: int = 0
    """Cap one request's prefill chunk per step (0: no cap beyond the budget)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_model_len: int = 0
    """Longest prompt + output a request may reach (0: the model's own limit)."""
    scheduling_policy: str = "fcfs"
    """'fcfs' or 'priority' (lower priority value runs first)."""
    enable_prefix_caching: bool = True
    """Reuse full KV blocks whose token prefix was already computed."""
    max_waiting_requests: int = 1024
    """Bound on the waiting queue; new requests beyond it are refused with 429."""
    max_waiting_tokens: int = 0
    """Bound on prompt tokens waiting (0: unbounded)."""
    queue_timeout_s: float = 60.0
    """A request not admitted to the running set within this many seconds ends with 503."""
    min_queue_timeout_s: float = 1.0
    """The floor for a per-request queue timeout."""
    num_kv_blocks: int = 0
    """Override the KV block count (0: the smallest count the workers report)."""
    num_workers: int = 1
    """Worker ranks this scheduler drives."""
    gateway_endpoint: str = f"ipc://{DEFAULT_RUNTIME_DIR}/gateway.sock"
    """ROUTER socket gateways connect to."""
    plan_endpoint: str = f"ipc://{DEFAULT_RUNTIME_DIR}/plan.sock"
    """PUB socket step plans go out on."""
    result_endpoint: str = f"ipc://{DEFAULT_RUNTIME_DIR}/result.sock"
    """PULL socket worker results come back on."""
    step_timeout_s: float = 120.0
    """A worker that heartbeats but has not answered a step in this long is declared hung.
    (A crashed worker is noticed sooner, by its missing heartbeats.) Generous on purpose:
    a long prefill chunk on a busy CPU can take tens of seconds."""
    gateway_timeout_s: float = 10.0
    """A gateway silent for this long has its requests aborted."""
    stats_interval_s: float = 0.25
    """How often EngineStats go to gateways."""
    worker_heartbeat_timeout_s: float = 5.0
    """A ready worker silent (no heartbeat, no result) for this long is declared dead."""
    shutdown_grace_s: float = 10.0
    """On SIGTERM: how long in-flight requests may run before the process stops anyway."""
    max_request_crashes: int = 2
    """A request running at this many consecutive worker crashes is ended with an error (0: never)."""
    engine_name: str = ""
    """This engine's name in the registry and in metrics' ``engine`` label ('': host-pid)."""
    redis_url: str = ""
    """Register this engine in Redis for the gateways' router ('': no registration)."""
    advertise_endpoint: str = ""
    """The address gateways connect to ('': the gateway endpoint; set it when that binds 0.0.0.0)."""
    registry_ttl_s: float = 10.0
    """The registration expires this long after the engine's last heartbeat."""
    health_port: int = 0
    """Serve GET /health and /ready over HTTP on this port, for Kubernetes probes (0: off)."""
    async_scheduling: bool = False
    """Plan step N+1 while the workers run step N (vLLM's name): hides the scheduler's
    per-step work behind the forward; a request that stops at N computes one discarded
    token in N+1. Off by default: see docs/benchmarks.md, "Serving against the offline engine"."""


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str = "smollm2-135m-instruct"
    """A local HF directory, a GGUF file, or a built-in name."""
    dtype: str = "auto"
    """'auto', 'bfloat16', 'float32', or 'float16' (GPU only: refused on a CPU)."""
    device: str = "cpu"
    """'cpu' or 'cuda'."""
    kv_cache_memory: int = 1 << 30
    """On CPU: bytes for the KV cache tensors."""
    gpu_memory_utilization: float = 0.9
    """On a GPU: fraction of device memory for weights + activations + KV."""
    block_size: int = 16
    max_model_len: int = 0
    """0: the model's own limit."""
    num_threads: int = 0
    """torch intra-op threads (0: all cores this process may use)."""
    rank: int = 0
    num_workers: int = 1
    plan_endpoint: str = f"ipc://{DEFAULT_RUNTIME_DIR}/plan.sock"
    result_endpoint: str = f"ipc://{DEFAULT_RUNTIME_DIR}/result.sock"
    cache_dir: str = ""
    """Where converted GGUF models are cached ('': ~/.cache/ferry)."""
    max_num_batched_tokens: int = 2048
    """On a GPU: the step token budget the activation peak is profiled at (the scheduler's knob)."""
    max_num_seqs: int = 128
    """On a GPU: the sampling rows the activation peak is profiled with (the scheduler's knob)."""
    tensor_parallel_size: int = 1
    """Ranks one model is split across (heads, MLP width and KV cache each 1/N); the scheduler's num_workers."""
    tp_init_method: str = ""
    """Where the tensor-parallel ranks rendezvous: file:///path (one host) or tcp://rank0-host:port."""
    attention_backend: str = "auto"
    """Paged attention implementation: 'auto' (the fastest correct one for the device) or a
    registered name ('reference', ...; docs/worker.md lists them)."""
    enforce_eager: bool = False
    """On a GPU: never capture CUDA graphs; every step runs eagerly (vLLM's name)."""
    quantization: str = "none"
    """'none' or 'int8' (W8A8: int8 weights and per-token int8 activations in the decoder's linear
    layers, SmoothQuant-calibrated at load; CPU only; docs/worker.md)."""
    kv_cache_dtype: str = "auto"
    """'auto' (the model's dtype) or 'fp8' (float8 e4m3, one byte per element: twice the tokens
    per byte of a bfloat16 cache; values saturate at +-448, no scales; CPU with the cpu_paged
    attention backend only; docs/worker.md)."""
    deterministic: bool = False
    """Batch-invariant numerics: a request's tokens and logprobs (seeded sampling included) do not
    depend on the other requests in its steps, on prefix-cache hits, chunk sizes or preemption
    (docs/api.md, "Deterministic outputs"; about 0.9x the output tok/s on prompt-heavy load)."""


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "smollm2-135m-instruct"
    """The model whose tokenizer and chat template the gateway uses."""
    served_model_name: str = ""
    """The name clients send as 'model' ('': the model argument)."""
    scheduler_endpoint: str = f"ipc://{DEFAULT_RUNTIME_DIR}/gateway.sock"
    """One engine's scheduler, or several separated by commas (data parallel)."""
    redis_url: str = ""
    """Redis for API keys, shared rate limits and the engine registry ('': none)."""
    redis_timeout_s: float = 0.1
    """Bound on each Redis call from the request path; past it the gateway falls back to local limits."""
    api_key: str = ""
    """A single static API key ('': keys from Redis, or none)."""
    admin_key: str = ""
    """A key for /metrics, /dashboard and /v1/config on a public bind (besides 'ferry keys add --admin' keys)."""
    allow_unauthenticated_public: bool = False
    """Allow binding a non-loopback host without any authentication."""
    auth_failure_limit: int = 30
    """Failed authentications one client address may make per minute before it is answered 429 (0: no limit)."""
    auth_failure_block_s: float = 60.0
    """How long an address over auth_failure_limit is answered 429 (valid keys are never throttled)."""
    forwarded_allow_ips: str = ""
    """Proxies whose X-Forwarded-For names the client: IPs or CIDRs, comma-separated, '*' any ('': none)."""
    max_body_bytes: int = 4 << 20
    max_n: int = 16
    metrics_compat: str = ""
    """'vllm' also exposes metrics under vLLM's exact names."""
    heartbeat_interval_s: float = 1.0
    """How often the gateway tells the scheduler it is alive."""
    default_rpm: int = 0
    """Per-gateway requests/minute per key when Redis is unreachable (0: unlimited)."""
    cache_dir: str = ""
    """Where converted GGUF tokenizers are cached ('': ~/.cache/ferry)."""
    scheduler_timeout_s: float = 10.0
    """A scheduler silent this long is treated as down (a dead process is noticed at once)."""
    shutdown_grace_s: float = 10.0
    """On SIGTERM: stop accepting, give in-flight requests this long to finish, then abort them."""
    max_inflight_requests: int = 2048
    """Generation requests this gateway serves at once; one more is a 429 before any work (0: unbounded)."""
    max_resumes: int = 3
    """Times one request is re-submitted after losing its scheduler (a crash is a pause; 0: fail with 503)."""
    resume_timeout_s: float = 300.0
    """How long the gateway holds in-flight streams open waiting for a scheduler to come back."""
    max_stop_strings: int = 16
    """Stop strings in one request (the schema's hard cap is 16)."""
    max_logit_bias: int = 1024
    """logit_bias entries in one request."""
    max_messages: int = 4096
    """Chat messages in one request (the schema's hard cap is 4096)."""
    max_tools: int = 128
    """Tools in one chat request."""
    max_prompts: int = 256
    """Prompts (strings or token-id lists) in one completion request."""
    max_list_items: int = 262144
    """Items in any one JSON list of a request body (token ids, allowed_token_ids, ...)."""
    body_timeout_s: float = 30.0
    """A request body that takes longer than this to arrive is refused with 408."""
    tool_call_parser: str = "hermes"
    """How tool_choice 'auto' output becomes tool_calls (vLLM's names): hermes, llama3_json, mistral."""
    routing_policy: str = "prefix"
    """Which engine serves a request: 'prefix' (affinity, load-bounded), 'least_loaded' or 'round_robin'."""
    routing_prefix_blocks: int = 4
    """Prefix affinity hashes the prompt's first this many KV blocks."""
    routing_load_factor: float = 1.25
    """No engine takes a request past this multiple of the mean load (plus the slack)."""
    routing_load_slack: int = 8
    """Requests an engine may carry above the load bound's multiple before affinity yields."""
    discover_engines: bool = True
    """With Redis: engines registered there join the routing (besides scheduler_endpoint's list)."""


# ---------------------------------------------------------------------------
# CLI / environment plumbing
# ---------------------------------------------------------------------------


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) for --help."""
    import ast
    import inspect

    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for prev, node in zip(body, body[1:], strict=False):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = node.value.value
    return docs


def add_config_args(
    parser: argparse.ArgumentParser,
    cls: type[msgspec.Struct],
    environ: typing.Mapping[str, str] | None = None,
    skip: typing.Collection[str] = (),
) -> None:
    """Add one ``--field-name`` flag per field; FERRY_FIELD_NAME sets its default."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    group = parser.add_argument_group(cls.__name__)
    for field in msgspec.structs.fields(cls):
        if field.name in skip:
            continue
        tp = _base_type(hints[field.name])
        conv: Any = _parse_bool if tp is bool else tp
        default = field.default
        env_name = "FERRY_" + field.name.upper()
        if env_name in env:
            default = conv(env[env_name])
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{docs.get(field.name, '')} [env {env_name}; default {default!r}]"
        if tp is bool:
            group.add_argument(
                flag, dest=field.name, type=_parse_bool, nargs="?", const=True,
                default=default, help=help_text,
            )
        else:
            group.add_argument(flag, dest=field.name, type=conv, default=default, help=help_text)


def config_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    values = {
        f.name: getattr(args, f.name)
        for f in msgspec.structs.fields(cls)
        if hasattr(args, f.name)
    }
    values.update(overrides)
    return msgspec.convert(values, cls)


def config_to_flags(config: msgspec.Struct) -> list[str]:
    """The inverse of ``config_from_args``: flags that rebuild ``config`` (for child processes)."""
    flags: list[str] = []
    for field in msgspec.structs.fields(type(config)):
        value = getattr(config, field.name)
        flags += ["--" + field.name.replace("_", "-"), str(value)]
    return flags


def config_as_dict(config: msgspec.Struct) -> dict[str, Any]:
    return typing.cast(dict[str, Any], msgspec.to_builtins(config))
