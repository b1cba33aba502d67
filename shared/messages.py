"""Every message that crosses a process boundary in ferry.

Each kind is a tagged ``msgspec.Struct`` encoded as MessagePack, so one socket
can carry a union of kinds and the decoder picks the right type from the tag.
Fields are append-only: add new ones at the end with a default, never reorder
or remove, so a gateway and a scheduler one release apart still talk.

Directions (see docs/architecture.md):

- gateway -> scheduler: ``AddRequest``, ``AbortRequest``, ``GatewayHeartbeat``
- scheduler -> gateway: ``RequestDeltas``, ``RequestRejected``, ``EngineStats``,
  ``EngineHealth``
- scheduler -> workers: ``StepPlan``, ``Shutdown``
- workers -> scheduler: ``WorkerReady``, ``StepResult``, ``WorkerError``

No pickle anywhere on the wire.
"""

from __future__ import annotations

import msgspec

# ---------------------------------------------------------------------------
# Parameters carried inside requests
# ---------------------------------------------------------------------------


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How the worker turns logits into a token. Validated by the gateway."""

    temperature: float = 1.0  # 0.0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None  # per-request stream, independent of the batch
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; 0: sampled token only; N: plus top-N
    # Token constraints (services/worker/logits_processors.py), applied after penalties.
    logit_bias: dict[int, float] = {}  # token id -> added to its logit (OpenAI's, in [-100, 100])
    allowed_token_ids: list[int] = []  # non-empty: every other token is masked out
    bad_words_token_ids: list[list[int]] = []  # a sequence's last token is masked when the rest was just output
    # An llguidance grammar (JSON, from shared/grammar.py); "" means unconstrained. The worker
    # compiles it once per distinct text and masks each sampled token to what it allows.
    grammar: str = ""


class StopParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Stop conditions the scheduler applies on token ids (text stops are the gateway's)."""

    max_tokens: int
    min_tokens: int = 0
    eos_token_ids: list[int] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class SampleLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Logprob of the sampled token plus the top-N alternatives (N may be 0)."""

    sampled: TokenLogprob
    top: list[TokenLogprob] = []


# ---------------------------------------------------------------------------
# gateway -> scheduler
# ---------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    req_id: str
    gateway_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: StopParams
    priority: int = 0  # lower value = more important (vLLM's convention)
    arrival_time: float = 0.0  # wall clock (time.time()) at the gateway
    queue_timeout_s: float | None = None  # None: the scheduler's default
    api_key_name: str | None = None
    # A continuation (the gateway re-submits a request after a scheduler restart): the
    # tokens already generated and streamed. They are outputs, not prompt, so max_tokens,
    # min_tokens, penalties and the seeded sampler's position all continue exactly.
    output_token_ids: list[int] = []


class AbortRequest(msgspec.Struct, tag=True, frozen=True):
    gateway_id: str
    req_ids: list[str]


class GatewayHeartbeat(msgspec.Struct, tag=True, frozen=True):
    gateway_id: str
    time: float


# ---------------------------------------------------------------------------
# scheduler -> gateway
# ---------------------------------------------------------------------------


class RequestTimings(msgspec.Struct, frozen=True, omit_defaults=True):
    """Wall-clock times (time.time()) in the scheduler's view of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None  # left the waiting queue
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


class RequestDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    req_id: str
    new_token_ids: list[int] = []
    logprobs: list[SampleLogprobs] | None = None  # one per new token when asked
    # "stop" | "length" | "abort" | "error" | "timeout"; None while running
    finish_reason: str | None = None
    stop_token_id: int | None = None  # the id that stopped it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    timings: RequestTimings | None = None  # sent with the first token and at finish
    error: str | None = None


class RequestDeltas(msgspec.Struct, tag=True, frozen=True):
    """All deltas of one step for one gateway, batched."""

    step_id: int
    deltas: list[RequestDelta]


class RequestRejected(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    req_id: str
    # "queue_full" | "queue_tokens_full" | "too_long" | "timeout" | "shutting_down" | "invalid"
    reason: str
    message: str
    retry_after_s: float | None = None


class RequestSummary(msgspec.Struct, frozen=True, array_like=True):
    """One row of the dashboard's running / waiting tables."""

    req_id: str
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    age_s: float


STEP_PHASES = ("schedule", "forward", "sample", "idle")  # EngineStats.step_phase_seconds_total keys


class EngineStats(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    time: float
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int  # free + cached-unreferenced
    kv_usage: float  # in-use blocks / total, 0..1
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0  # tokens looked up
    prefix_cache_hits_total: int = 0  # tokens found
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    steps_total: int = 0
    worker_restarts_total: int = 0
    num_running_by_priority: dict[int, int] = {}
    num_waiting_by_priority: dict[int, int] = {}
    rejected_total: dict[str, int] = {}  # by reason
    finished_total: dict[str, int] = {}  # by finish reason
    # per-step samples since the previous EngineStats (for histograms)
    step_num_tokens: list[int] = []
    step_num_seqs: list[int] = []
    step_duration_s: list[float] = []
    running: list[RequestSummary] = []  # capped, for the dashboard
    waiting: list[RequestSummary] = []
    drain_rate_rps: float = 0.0  # requests leaving the waiting queue per second
    config: dict[str, str] = {}  # effective scheduler knobs, for /v1/config
    # resident memory of the scheduler and each worker ("scheduler", "worker0", ...)
    process_rss_bytes: dict[str, int] = {}
    process_peak_rss_bytes: dict[str, int] = {}
    device_memory_peak_bytes: dict[str, int] = {}  # per worker, on a GPU
    workers_ready: list[int] = []
    # Where step time goes, per step since the previous EngineStats: the
    # scheduler's own schedule() + send, the worker's forward and sample, and idle =
    # the rest of the step cycle (result N received -> result N+1 received) in which
    # the worker did not compute: scheduler bookkeeping, transport, waiting for a plan.
    step_schedule_s: list[float] = []
    step_forward_s: list[float] = []
    step_sample_s: list[float] = []
    step_idle_s: list[float] = []
    # cumulative seconds per phase ("schedule", "forward", "sample", "idle") and tokens
    # scheduled over all steps, so windowed shares survive capped per-step samples
    step_phase_seconds_total: dict[str, float] = {}
    step_tokens_total: int = 0


class EngineHealth(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    time: float
    scheduler_ready: bool
    num_workers: int
    workers_ready: list[int] = []  # ranks that are up
    model: str = ""
    max_model_len: int = 0
    block_size: int = 0
    detail: str = ""
    workers: list[WorkerReady] = []  # what each ready rank announced (for /v1/config)
    config: dict[str, int | float | bool | str] = {}  # effective scheduler knobs, typed (for /v1/config)
    # A random id per scheduler process: a gateway that sees it change knows the requests
    # it sent to the previous one are gone, even if it never saw the connection drop.
    incarnation: str = ""


# ---------------------------------------------------------------------------
# scheduler -> workers
# ---------------------------------------------------------------------------


class NewRequestData(msgspec.Struct, frozen=True, omit_defaults=True):
    """A request the worker has not seen (or must rebuild after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit (or 0 after preemption)
    output_token_ids: list[int] = []  # tokens generated before a preemption
    # a hybrid KV cache (shared.capacity.HybridKV): the windowed layers' block table, by position
    # like block_ids (-1: a block its window has left behind, released)
    window_block_ids: list[int] = []


class CachedRequestData(msgspec.Struct, frozen=True, array_like=True):
    """A request the worker already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_window_block_ids: list[int] = []  # a hybrid KV cache: the windowed layers' new blocks


class StepPlan(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """What every worker rank runs in one step. Differences, not the whole batch.

    The worker samples a token for a request when ``num_computed_tokens +
    num_scheduled_tokens[req_id]`` reaches the request's token count (prompt
    plus outputs); a partial prefill chunk samples nothing.
    """

    step_id: int
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    resumed_requests: list[NewRequestData] = []  # re-admitted after preemption
    preempted_req_ids: list[str] = []  # drop from the persistent batch
    finished_req_ids: list[str] = []  # finished or aborted since last plan
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    reason: str = ""
    rank: int | None = None  # None: every rank; else only that rank exits (to be restarted)
    pid: int = 0  # with ``rank``: only that process (0: any); a restarted rank's new process stays


# ---------------------------------------------------------------------------
# workers -> scheduler
# ---------------------------------------------------------------------------


class WorkerReady(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    rank: int
    num_kv_blocks: int
    block_size: int
    model: str = ""
    max_model_len: int = 0
    vocab_size: int = 0
    pid: int = 0
    kv_cache_bytes: int = 0
    weight_bytes: int = 0
    dtype: str = ""  # resolved weight dtype ("auto" never appears here)
    device: str = ""
    num_threads: int = 0  # torch intra-op threads
    tensor_parallel_size: int = 1  # >1: the ranks are shards that fail and restart as one group
    # a hybrid KV cache (shared.capacity.HybridKV): num_kv_blocks is then the global layers' pool
    window: int = 0
    num_window_blocks: int = 0


class StepResult(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """Sampled tokens of one step: ``req_ids[i]`` sampled ``sampled_token_ids[i]``."""

    step_id: int
    rank: int
    req_ids: list[str] = []
    sampled_token_ids: list[int] = []
    logprobs: list[SampleLogprobs | None] = []  # parallel to req_ids when any asked
    forward_s: float = 0.0
    sample_s: float = 0.0


class WorkerHeartbeat(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    """Sent every second from a side thread, also while a long forward runs."""

    rank: int
    pid: int
    time: float
    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    device_memory_peak_bytes: int = 0


class WorkerError(msgspec.Struct, tag=True, frozen=True, omit_defaults=True):
    rank: int
    message: str
    step_id: int | None = None
    fatal: bool = True


# ---------------------------------------------------------------------------
# Unions per socket direction, and reusable codecs
# ---------------------------------------------------------------------------

ToScheduler = AddRequest | AbortRequest | GatewayHeartbeat
ToGateway = RequestDeltas | RequestRejected | EngineStats | EngineHealth
ToWorker = StepPlan | Shutdown
FromWorker = WorkerReady | StepResult | WorkerHeartbeat | WorkerError
AnyMessage = ToScheduler | ToGateway | ToWorker | FromWorker

ENCODER = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return ENCODER.encode(msg)


to_scheduler_decoder: msgspec.msgpack.Decoder[ToScheduler] = msgspec.msgpack.Decoder(ToScheduler)
to_gateway_decoder: msgspec.msgpack.Decoder[ToGateway] = msgspec.msgpack.Decoder(ToGateway)
to_worker_decoder: msgspec.msgpack.Decoder[ToWorker] = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder: msgspec.msgpack.Decoder[FromWorker] = msgspec.msgpack.Decoder(FromWorker)
any_decoder: msgspec.msgpack.Decoder[AnyMessage] = msgspec.msgpack.Decoder(AnyMessage)
