"""Admission control: whether a new request may enter the waiting queue at all.

Refusals carry a reason the gateway maps to an HTTP status ("too_long" and
"invalid" are 400, the queue reasons are 429 with ``Retry-After``) and a message
that names the limit and what was asked, so a client can fix or retry.
"""

from __future__ import annotations

from shared.config import SchedulerConfig
from shared.messages import AddRequest, RequestRejected

RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0
RETRY_AFTER_UNKNOWN_S = 5.0  # no request has left the queue recently: no rate to estimate from


def retry_after_s(num_waiting: int, drain_rate_rps: float) -> float:
    """Seconds until the current queue has likely drained, from the measured drain rate."""
    if drain_rate_rps <= 0:
        return RETRY_AFTER_UNKNOWN_S
    return round(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, num_waiting / drain_rate_rps)), 1)


def check_request(
    req: AddRequest,
    config: SchedulerConfig,
    max_model_len: int,
    kv_capacity_tokens: int,
    is_duplicate: bool,
) -> RequestRejected | None:
    """Reasons this request can never run, independent of the current load."""
    num_prompt = len(req.prompt_token_ids)
    max_tokens = req.stop.max_tokens
    if is_duplicate:
        return RequestRejected(req.req_id, "invalid", f"request id {req.req_id!r} is already in use")
    if num_prompt == 0:
        return RequestRejected(req.req_id, "invalid", "the prompt is empty: at least one token is needed")
    if max_tokens < 1:
        return RequestRejected(req.req_id, "invalid", f"max_tokens must be at least 1, got {max_tokens}")
    if len(req.output_token_ids) >= max_tokens:
        return RequestRejected(
            req.req_id, "invalid",
            f"a continuation with {len(req.output_token_ids)} tokens already generated has no budget left "
            f"(max_tokens {max_tokens})",
        )
    if num_prompt + max_tokens > max_model_len:
        return RequestRejected(
            req.req_id, "too_long",
            f"this model's maximum context length is {max_model_len} tokens, but {num_prompt + max_tokens} "
            f"were requested ({num_prompt} in the prompt, {max_tokens} for the completion)",
        )
    if num_prompt + max_tokens > kv_capacity_tokens:
        return RequestRejected(
            req.req_id, "too_long",
            f"the KV cache holds {kv_capacity_tokens} tokens, but this request may need "
            f"{num_prompt + max_tokens} ({num_prompt} in the prompt, {max_tokens} for the completion)",
        )
    if not config.enable_chunked_prefill and num_prompt > config.max_num_batched_tokens:
        return RequestRejected(
            req.req_id, "too_long",
            f"chunked prefill is off and a step holds {config.max_num_batched_tokens} tokens, "
            f"but the prompt has {num_prompt}",
        )
    return None


def check_queue(
    req: AddRequest,
    config: SchedulerConfig,
    num_waiting: int,
    num_waiting_tokens: int,
    drain_rate_rps: float,
) -> RequestRejected | None:
    """Whether the bounded waiting queue has room for this request now."""
    if num_waiting >= config.max_waiting_requests:
        return RequestRejected(
            req.req_id, "queue_full",
            f"the waiting queue is full ({num_waiting} of {config.max_waiting_requests} requests)",
            retry_after_s=retry_after_s(num_waiting, drain_rate_rps),
        )
    num_prompt = len(req.prompt_token_ids)
    # An empty queue takes any prompt, so one long prompt is never refused forever.
    if 0 < config.max_waiting_tokens < num_waiting_tokens + num_prompt and num_waiting_tokens > 0:
        return RequestRejected(
            req.req_id, "queue_tokens_full",
            f"the waiting queue holds {num_waiting_tokens} prompt tokens of {config.max_waiting_tokens}; "
            f"this prompt adds {num_prompt}",
            retry_after_s=retry_after_s(num_waiting, drain_rate_rps),
        )
    return None
