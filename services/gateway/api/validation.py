"""From a parsed request body to a ``GenerationSpec``: the checks that need the model or config.

``protocol.py`` already refused wrong types, non-finite floats and out-of-range
numbers. Here: the model name (404), unsupported features, ``n`` against
``max_n``, token ids against the vocabulary, empty prompts, and the context
length (prompt tokens + max_tokens against max_model_len, saying both numbers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway.errors import APIError, bad_request
from services.gateway.protocol import MAX_SEED, ChatCompletionRequest, CompletionRequest, SamplingFields
from services.gateway.text import structured
from services.gateway.text.tokenizer import ChatTemplateError, GatewayTokenizer
from services.gateway.text.tools import ToolPlan, plan_tools
from shared.grammar import GrammarError
from shared.messages import AddRequest, SamplingParams, StopParams


@dataclass(frozen=True)
class ServingLimits:
    served_model_names: frozenset[str]
    max_n: int
    max_model_len: int  # 0: unknown, no context check
    tool_call_parser: str = "hermes"  # how tool_choice "auto" output is read (text/tool_parsers/)


@dataclass
class GenerationSpec:
    """Everything needed to submit one HTTP request's sub-requests and render the answer."""

    prompts: list[list[int]]
    n: int
    max_tokens: list[int]  # per prompt
    sampling: SamplingParams
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int]
    stop_strings: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    priority: int | None
    queue_timeout_s: float | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None  # None: none; else top-N alternatives
    eos_token_ids: list[int] = field(default_factory=list)
    tool_plan: ToolPlan | None = None  # chat with tools: how the output is read into tool_calls

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def max_total_tokens(self) -> int:
        return sum(m for m in self.max_tokens) * self.n

    def add_requests(self, base_id: str, gateway_id: str, arrival_time: float, priority: int,
                     api_key_name: str | None) -> list[AddRequest]:
        """One AddRequest per choice; seeded requests get seed + i so choices differ."""
        out: list[AddRequest] = []
        for p, prompt in enumerate(self.prompts):
            stop = StopParams(max_tokens=self.max_tokens[p], min_tokens=self.min_tokens,
                              eos_token_ids=self.eos_token_ids, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos)
            for i in range(self.n):
                sampling = self.sampling
                if sampling.seed is not None and i > 0:
                    sampling = _with_seed(sampling, sampling.seed + i)
                out.append(AddRequest(
                    req_id=f"{base_id}-{p * self.n + i}", gateway_id=gateway_id, prompt_token_ids=prompt,
                    sampling=sampling, stop=stop, priority=priority, arrival_time=arrival_time,
                    queue_timeout_s=self.queue_timeout_s, api_key_name=api_key_name))
        return out


def _with_seed(s: SamplingParams, seed: int) -> SamplingParams:
    return msgspec.structs.replace(s, seed=seed)


def check_model(name: str, limits: ServingLimits) -> None:
    if name not in limits.served_model_names:
        served = ", ".join(sorted(limits.served_model_names))
        raise APIError(404, f"the model {name!r} does not exist; this server serves: {served}",
                       param="model", code="model_not_found")


def _check_common(req: CompletionRequest | ChatCompletionRequest, tok: GatewayTokenizer,
                  limits: ServingLimits) -> None:
    """The checks completions and chat share, in the order both report them."""
    check_model(req.model, limits)
    if req.n > limits.max_n:
        raise bad_request(f"n={req.n} is more than this server allows (max_n={limits.max_n})", "n")
    if req.top_k is not None and req.top_k > tok.vocab_size:
        raise bad_request(f"top_k={req.top_k} is larger than the vocabulary ({tok.vocab_size})", "top_k")
    for t in req.stop_token_ids or []:
        if t >= tok.vocab_size:
            raise bad_request(f"stop_token_ids: {t} is outside the vocabulary (0..{tok.vocab_size - 1})",
                              "stop_token_ids")
    if req.seed is not None and req.seed + req.n - 1 > MAX_SEED:
        raise bad_request(f"seed must be at most {MAX_SEED - req.n + 1} with n={req.n}", "seed")
    if req.echo:
        raise bad_request("echo=true is not supported", "echo", code="unsupported")


def _check_prompt_ids(ids: Sequence[int], tok: GatewayTokenizer, param: str) -> None:
    if not ids:
        raise bad_request("the prompt is empty", param, code="empty_prompt")
    bad = next((t for t in ids if t >= tok.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{tok.vocab_size - 1})", param)


def _check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens={min_tokens} is more than max_tokens={max_tokens}", "min_tokens")


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, limits: ServingLimits,
                       param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    """The max_tokens to use, refusing prompts that (with max_tokens) overflow max_model_len."""
    limit = limits.max_model_len
    if limit <= 0:
        return requested if requested is not None else 256
    if num_prompt_tokens >= limit:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens, but this model's context length "
            f"(max_model_len) is {limit} tokens, leaving no room to generate; shorten the prompt",
            prompt_param, code="context_length_exceeded")
    if requested is None:
        return limit - num_prompt_tokens
    if num_prompt_tokens + requested > limit:
        raise bad_request(
            f"this model's context length (max_model_len) is {limit} tokens, but {num_prompt_tokens + requested} "
            f"were requested ({num_prompt_tokens} in the prompt + {param}={requested}); "
            f"lower {param} to at most {limit - num_prompt_tokens} or shorten the prompt",
            param, code="context_length_exceeded")
    return requested


def _constraints(req: SamplingFields, tok: GatewayTokenizer, forced: str = "") -> dict[str, Any]:
    """The SamplingParams fields of structured outputs and token constraints, each checked (400s)."""
    fields = structured.token_constraints(req, tok)
    grammar, param = structured.request_grammar(req)
    if forced:
        if grammar:
            raise bad_request("a forced tool_choice already constrains the output; drop the structured-output "
                              "field", param)
        grammar, param = forced, "tools"  # compiled from the tools' parameters schemas
    if grammar:
        if req.ignore_eos:
            raise bad_request("ignore_eos cannot be combined with a grammar (the grammar ends at EOS)", "ignore_eos")
        structured.check(tok, grammar, param)
        fields["grammar"] = grammar
    return fields


def _spec(req: SamplingFields, prompts: list[list[int]], max_tokens: list[int], logprobs: int | None,
          tok: GatewayTokenizer, constraints: dict[str, Any] | None = None) -> GenerationSpec:
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
        min_p=req.min_p or 0.0, seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logprobs=logprobs, **(constraints or {}))
    opts = req.stream_options
    return GenerationSpec(
        prompts=prompts, n=req.n, max_tokens=max_tokens, sampling=sampling, min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos, stop_token_ids=list(req.stop_token_ids or []),
        stop_strings=req.stop_strings(), include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, priority=req.priority, queue_timeout_s=req.queue_timeout_s,
        stream=req.stream, include_usage=bool(opts and opts.include_usage),
        continuous_usage=bool(opts and opts.continuous_usage_stats), logprobs=logprobs,
        eos_token_ids=list(tok.eos_token_ids))


def completion_prompts(req: CompletionRequest, tok: GatewayTokenizer) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        texts: list[str] | None = [p]
    elif p and all(isinstance(x, str) for x in p):
        texts = [str(x) for x in p]
    else:
        texts = None
    if texts is not None:
        if any(t == "" for t in texts):
            raise bad_request("the prompt is empty", "prompt", code="empty_prompt")
        prompts = [tok.encode(t, add_special_tokens=req.add_special_tokens) for t in texts]
    elif not p:
        raise bad_request("the prompt is empty", "prompt", code="empty_prompt")
    elif all(isinstance(x, int) for x in p):
        prompts = [[int(x) for x in p]]  # type: ignore[arg-type]
    else:
        prompts = [list(x) for x in p]  # type: ignore[arg-type]
    for ids in prompts:
        _check_prompt_ids(ids, tok, "prompt")
    return prompts


def validate_completion(req: CompletionRequest, tok: GatewayTokenizer, limits: ServingLimits) -> GenerationSpec:
    _check_common(req, tok, limits)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix", code="unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (it must equal n)", "best_of", code="unsupported")
    prompts = completion_prompts(req, tok)
    if len(prompts) * req.n > limits.max_n * 16:
        raise bad_request(f"{len(prompts)} prompts x n={req.n} is too many choices in one request", "prompt")
    max_tokens = [resolve_max_tokens(len(p), req.max_tokens, limits) for p in prompts]
    _check_min_tokens(req.min_tokens, min(max_tokens))
    return _spec(req, prompts, max_tokens, req.logprobs, tok, _constraints(req, tok))


def render_chat(tok: GatewayTokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                template_kwargs: dict[str, Any] | None = None) -> str:
    try:
        return tok.apply_chat_template(messages, add_generation_prompt, **(template_kwargs or {}))
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages", code="invalid_messages") from e
    except (TypeError, ValueError) as e:  # a template tripping over unusual input
        raise bad_request(f"the chat template failed on these messages: {e}", "messages") from e


def chat_prompt(req: ChatCompletionRequest, tok: GatewayTokenizer, tools: list[dict[str, Any]] | None = None) -> list[int]:
    kwargs = dict(req.chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    text = render_chat(tok, req.template_messages(), req.add_generation_prompt, kwargs)
    # the template writes the special tokens itself; adding them again would double the BOS
    return tok.encode(text, add_special_tokens=False)


def validate_chat(req: ChatCompletionRequest, tok: GatewayTokenizer, limits: ServingLimits) -> GenerationSpec:
    _check_common(req, tok, limits)
    try:
        tool_plan = plan_tools(req, limits.tool_call_parser, "tools" in (tok.chat_template or ""))
    except GrammarError as e:
        raise bad_request(f"a tool's parameters are not a usable JSON schema: {e}", "tools",
                          code="invalid_grammar") from e
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
    constraints = _constraints(req, tok, tool_plan.grammar)
    prompt = chat_prompt(req, tok, tool_plan.template_tools)
    _check_prompt_ids(prompt, tok, "messages")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(len(prompt), requested, limits, param, "messages")
    _check_min_tokens(req.min_tokens, max_tokens)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    spec = _spec(req, [prompt], [max_tokens], logprobs, tok, constraints)
    spec.tool_plan = tool_plan if tool_plan.parser is not None else None
    return spec
