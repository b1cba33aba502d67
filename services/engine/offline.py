"""The offline engine: scheduler and model runner in one process, for batch jobs and tests.

    from services.engine.offline import LLM, GenerationParams
    llm = LLM(model="smollm2-135m-instruct", dtype="float32", kv_cache_memory=256 << 20)
    outs = llm.generate(["Once upon a time"], GenerationParams(max_tokens=32, temperature=0))
    outs = llm.chat([[{"role": "user", "content": "Hi"}]], GenerationParams(max_tokens=32))

The loop is the engine replica's, minus the sockets: ``schedule()`` a plan,
``execute`` it, ``update_from_result``, collect the deltas. Requests are fed to
the scheduler as its waiting queue has room, so any number of prompts works,
and they wait as long as needed (no queue timeout offline).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.scheduler.scheduler import Scheduler
from services.worker.runner import ModelRunner, set_num_threads
from shared.config import SchedulerConfig, WorkerConfig
from shared.heap import keep_freed_memory
from shared.messages import (
    AddRequest,
    RequestDelta,
    RequestTimings,
    SampleLogprobs,
    SamplingParams,
    StopParams,
)
from shared.models import DEFAULT_MODEL

from .tp_ranks import HelperRanks

GATEWAY_ID = "offline"
MAX_IDLE_STEPS = 1000  # steps that schedule nothing while work remains: a scheduler bug, not a wait


@dataclass(frozen=True)
class GenerationParams:
    """Sampling plus stop conditions for one request (OpenAI / vLLM names)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one found
    # token constraints (see SamplingParams): an llguidance grammar from shared/grammar.py, and the rest
    grammar: str = ""
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=self.logprobs,
            logit_bias=dict(self.logit_bias), allowed_token_ids=list(self.allowed_token_ids),
            bad_words_token_ids=[list(w) for w in self.bad_words_token_ids], grammar=self.grammar,
        )

    def stop_params(self, eos_token_ids: list[int]) -> StopParams:
        return StopParams(
            max_tokens=self.max_tokens, min_tokens=self.min_tokens, eos_token_ids=list(eos_token_ids),
            stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
        )


@dataclass
class Output:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | a rejection reason
    logprobs: list[SampleLogprobs] | None = None
    num_cached_tokens: int = 0
    timings: RequestTimings | None = None
    error: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if any


class LLM:
    """Generate from many prompts at once with continuous batching over the paged KV cache."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str = "auto",
        device: str = "cpu",
        kv_cache_memory: int = 1 << 30,
        block_size: int = 16,
        max_model_len: int = 0,
        num_threads: int = 0,
        cache_dir: str = "",
        tensor_parallel_size: int = 1,
        attention_backend: str = "auto",
        quantization: str = "none",
        kv_cache_dtype: str = "auto",
        deterministic: bool = False,
        **scheduler_knobs: Any,
    ) -> None:
        set_num_threads(num_threads)
        knobs = {"queue_timeout_s": 0.0, **scheduler_knobs, "block_size": block_size}
        self.scheduler_config = msgspec.convert(knobs, SchedulerConfig)
        self.worker_config = WorkerConfig(
            model=model, dtype=dtype, device=device, kv_cache_memory=kv_cache_memory, block_size=block_size,
            max_model_len=max_model_len, num_threads=num_threads, cache_dir=cache_dir,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            max_num_seqs=self.scheduler_config.max_num_seqs, tensor_parallel_size=tensor_parallel_size,
            attention_backend=attention_backend, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            deterministic=deterministic,
        )
        # tensor parallel: ranks 1..N-1 in child processes, rank 0 here (tp_ranks.py)
        self.helpers = HelperRanks(self.worker_config) if tensor_parallel_size > 1 else None
        try:
            config = self.helpers.rank0_config(self.worker_config) if self.helpers else self.worker_config
            self.runner = ModelRunner(config)
            others = self.helpers.wait_ready() if self.helpers else []
        except BaseException:
            self.close()
            raise
        # The engine owns its process's stepping: freed step buffers stay in the heap for the
        # next step instead of coming back as fresh pages (shared/heap.py; FERRY_MALLOC_KEEP=0: off).
        keep_freed_memory()
        self._tokenizer: Any = None
        self._next_id = 0
        # the KV block count is the smallest any rank has (as the scheduler service does)
        self.num_kv_blocks = min([self.runner.num_kv_blocks] + [n for n, _ in others])
        max_model_len = min([self.runner.max_model_len] + [m for _, m in others])
        hybrid = self.runner.hybrid_kv
        self.scheduler = Scheduler(self.scheduler_config, self.num_kv_blocks, max_model_len,
                                   window=hybrid.window if hybrid else 0,
                                   num_window_blocks=hybrid.num_window_blocks if hybrid else 0)

    def close(self) -> None:
        """Stop the helper ranks and leave the tensor-parallel group (a no-op without one)."""
        helpers, self.helpers = getattr(self, "helpers", None), None
        if helpers is not None:
            helpers.close()
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.runner.model_dir)
        return self._tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        params: GenerationParams | Sequence[GenerationParams] | None = None,
        decode: bool = True,
    ) -> list[Output]:
        """One output per prompt, in order. Prompts are text or token id lists."""
        items: list[Any] = [prompts] if isinstance(prompts, str) else list(prompts)
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items]
        if params is None or isinstance(params, GenerationParams):
            param_list = [params or GenerationParams()] * len(token_lists)
        else:
            param_list = list(params)
        if len(param_list) != len(token_lists):
            raise ValueError(f"{len(token_lists)} prompts but {len(param_list)} parameter sets")
        outputs = self._run(token_lists, param_list)
        if decode:
            for out in outputs:
                if out.stop_string is None:
                    out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return outputs

    def chat(
        self,
        conversations: Sequence[Sequence[dict[str, str]]],
        params: GenerationParams | Sequence[GenerationParams] | None = None,
    ) -> list[Output]:
        """Apply the tokenizer's chat template (with the assistant prompt) to each conversation."""
        token_lists = [self.chat_token_ids(c) for c in conversations]
        return self.generate(token_lists, params)

    def chat_token_ids(self, conversation: Sequence[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    # ------------------------------------------------------------------
    def _run(self, token_lists: list[list[int]], params: list[GenerationParams]) -> list[Output]:
        outputs: dict[str, Output] = {}
        pending: list[AddRequest] = []
        eos = self.runner.eos_token_ids
        for tokens, p in zip(token_lists, params, strict=True):
            req_id = f"offline-{self._next_id}"
            self._next_id += 1
            outputs[req_id] = Output(req_id, tokens, logprobs=[] if p.logprobs is not None else None)
            pending.append(AddRequest(
                req_id=req_id, gateway_id=GATEWAY_ID, prompt_token_ids=tokens, sampling=p.sampling(),
                stop=p.stop_params(eos), arrival_time=time.time(),
            ))
        stops = {req.req_id: p.stop for req, p in zip(pending, params, strict=True) if p.stop}
        pending.reverse()  # pop() from the end keeps submission order
        sched = self.scheduler
        idle = 0
        while pending or sched.has_unfinished_requests():
            while pending and sched.num_waiting < self.scheduler_config.max_waiting_requests:
                req = pending.pop()
                rejected = sched.add_request(req)
                if rejected is not None:
                    out = outputs[req.req_id]
                    out.finish_reason, out.error = rejected.reason, rejected.message
            plan = sched.schedule()
            if self.helpers is not None:
                self.helpers.send(plan)  # every rank runs every plan; rank 0's result is the one read
            result = self.runner.execute(plan)
            sched.update_from_result(plan, result)
            idle = 0 if plan.total_num_scheduled_tokens else idle + 1
            if idle > MAX_IDLE_STEPS:
                raise RuntimeError(f"the scheduler made no progress for {idle} steps with work remaining")
            for deltas in sched.take_deltas().values():
                for delta in deltas:
                    _apply_delta(outputs[delta.req_id], delta)
            self._check_stop_strings(outputs, stops)
        return list(outputs.values())

    def _check_stop_strings(self, outputs: dict[str, Output], stops: dict[str, tuple[str, ...]]) -> None:
        """Abort requests whose text now contains a stop string (decoded in full: only they pay)."""
        hits: list[str] = []
        for req_id, strings in stops.items():
            out = outputs[req_id]
            if out.finish_reason is not None or not out.token_ids:
                continue
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            found = [(i, s) for s in strings if (i := text.find(s)) >= 0]
            if found:
                cut, string = min(found)
                out.text, out.finish_reason, out.stop_string = text[:cut], "stop", string
                hits.append(req_id)
        if hits:
            self.scheduler.abort_requests(hits)
            self.scheduler.take_deltas()  # the abort deltas: the outputs are already final
        for req_id in hits:
            stops.pop(req_id)


def _apply_delta(out: Output, delta: RequestDelta) -> None:
    out.token_ids.extend(delta.new_token_ids)
    if delta.logprobs is not None and out.logprobs is not None:
        out.logprobs.extend(delta.logprobs)
    if delta.num_cached_tokens:
        out.num_cached_tokens = delta.num_cached_tokens
    if delta.timings is not None:
        out.timings = delta.timings
    if delta.finish_reason is not None:
        out.finish_reason = delta.finish_reason
        out.error = delta.error
