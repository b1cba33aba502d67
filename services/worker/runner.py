"""The model runner: one ``StepPlan`` in, one forward over all scheduled tokens, one ``StepResult`` out.

``ModelRunner(config)`` loads the model, sizes and allocates the KV cache, and
keeps the persistent batch state. ``execute(plan)``:

1. applies the plan's differences to the batch state;
2. packs the scheduled tokens of every request on one axis with their
   positions (``num_computed_tokens`` onwards) and KV slots;
3. describes the step's attention once as a ``PagedBatch`` (decodes first), lets the
   selected attention backend ``prepare`` it, and runs transformers' model body once
   with ``ferry_meta`` (see model/attention.py and backends/);
4. gathers the hidden state of the last scheduled token of each request that
   samples this step (its chunk reaches the end of its tokens) and applies the
   LM head to those rows only;
5. samples, appends each sampled token to its request, and returns them.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from shared.capacity import (
    gpu_kv_budget_bytes,
    hybrid_kv_blocks,
    kv_shape_from_config,
    window_blocks_per_sequence,
)
from shared.config import WorkerConfig
from shared.grammar import load_tokenizer
from shared.messages import StepPlan, StepResult
from shared.models import resolve_model, tokenizer_dir

from .backends import PagedBatch, select_backend
from .backends.build import build_paged_batch
from .batch import BatchState, RequestState
from .cuda.graphs import graph_batch_sizes, graph_memory_estimate, setup_decode_graphs
from .cuda.staging import StepStaging
from .kv_cache import FP8, KVCache, kv_cache_torch_dtype, kv_dtype_name, num_blocks_for_budget
from .loader import load_model
from .logits_processors import ConstraintTracker
from .model import tensor_parallel
from .model.attention import ModelRefused, StepAttention, WindowStep
from .model.fused_ops import kernels as fused_kernels
from .model.output_head import with_output_transform
from .model.prepare import prepare_cpu_weights
from .model.probe import check_model, scratch_prompt
from .sampler import Sampler

log = logging.getLogger("ferry.worker.runner")


def set_num_threads(num_threads: int) -> int:
    """torch intra-op threads; 0 means every core this process may run on."""
    n = num_threads if num_threads > 0 else len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n


@dataclass
class PackedInputs:
    input_ids: torch.Tensor  # [1, num_tokens]
    positions: torch.Tensor  # [1, num_tokens]
    attention: StepAttention
    sample_states: list[RequestState]
    sample_token_idx: torch.Tensor  # [num_sampling] index of each sampling row's last token
    batch: PagedBatch  # the step's attention work (on the device)


class ModelRunner:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        loaded = load_model(config.model, config.dtype, config.device, config.cache_dir, config.quantization)
        # tensor parallel: shard the model for this rank and join the group (None: off)
        self.tp = tensor_parallel.setup(config, loaded.model, loaded.config_dict)
        kv_config = self.tp.kv_config(loaded.config_dict) if self.tp else loaded.config_dict
        self.model = loaded.model
        self.body = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.dtype = loaded.dtype
        self.hf_config = loaded.hf_config
        self.model_name = config.model
        self.model_dir = loaded.model_dir
        self.load_s = loaded.load_s
        self.vocab_size = int(loaded.config_dict["vocab_size"])
        self.eos_token_ids = _eos_ids(loaded.config_dict, loaded.model.generation_config)
        model_limit = int(loaded.config_dict.get("max_position_embeddings") or 0) or 1 << 20
        self.max_model_len = min(config.max_model_len, model_limit) if config.max_model_len > 0 else model_limit
        self.block_size = config.block_size
        self.weight_bytes = _weight_bytes(self.model)
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        # the backend first: a float8 cache it cannot read is refused before any memory is committed
        self.attn_backend = select_backend(config.attention_backend, self.device)
        log.info("attention backend: %s", self.attn_backend.name)
        if config.deterministic:
            check_deterministic(config, self.attn_backend.name)
            self.attn_backend.make_batch_invariant()
        if self.kv_dtype == FP8 and self.attn_backend.name != "cpu_paged":
            raise ValueError(f"kv_cache_dtype 'fp8' needs the CPU and its cpu_paged attention backend, not "
                             f"{self.device.type} / {self.attn_backend.name!r} (the CPU kernels: make kernels)")
        budget = self._kv_budget(kv_config)
        # windowed layers keep only what their window reaches: their own, smaller pool (shared.capacity)
        # (one rank only for now: the load-time probe, which checks the layers' windows, runs on one)
        self.hybrid_kv = None if self.tp is not None else hybrid_kv_blocks(
            budget, kv_config, kv_dtype_name(self.kv_dtype), self.block_size, config.max_num_seqs,
            config.max_num_batched_tokens, self.max_model_len)
        layer_blocks = None
        if self.hybrid_kv is not None:
            h = self.hybrid_kv
            self.num_kv_blocks = h.num_full_blocks
            one_step = window_blocks_per_sequence(h.window, self.block_size) + -(-config.max_num_batched_tokens
                                                                                 // self.block_size)
            if h.num_window_blocks < one_step or h.num_full_blocks < 1:
                # a request whose window and chunk do not fit the windowed pool would wait forever
                raise ValueError(f"KV budget of {budget} bytes is too small for this model's hybrid KV cache: its "
                                 f"windowed layers need {one_step} blocks of {self.block_size} tokens for one "
                                 f"sequence's window of {h.window} and one step of {config.max_num_batched_tokens} "
                                 f"tokens; they get {h.num_window_blocks}")
            num_layers = kv_shape_from_config(kv_config)[0]
            layer_blocks = [h.num_window_blocks if i in h.window_layers else h.num_full_blocks
                            for i in range(num_layers)]
            log.info("hybrid KV cache: %d layers with windows of %d tokens in %d blocks, %d global layers in %d",
                     len(h.window_layers), h.window, h.num_window_blocks, num_layers - len(h.window_layers),
                     h.num_full_blocks)
        else:
            self.num_kv_blocks = num_blocks_for_budget(budget, kv_config, self.kv_dtype, self.block_size)
        if self.num_kv_blocks < 1:
            raise ValueError(f"KV budget of {budget} bytes holds no block of {self.block_size} tokens")
        self.kv = KVCache.allocate(kv_config, self.num_kv_blocks, self.block_size, self.kv_dtype, config.device,
                                   layer_blocks=layer_blocks)
        self.kv_cache_bytes = self.kv.nbytes
        # CPU: fused and packed linears, int8, the tied head and the lean forward (model/prepare.py)
        # a W8A8 int8 checkpoint's layers on ferry's int8 path (model/checkpoint_quant.py): CPU, one rank
        scheme = loaded.checkpoint_scheme
        self.checkpoint_int8 = (scheme is not None and scheme.int8_layers and self.device.type == "cpu"
                                and self.tp is None)
        quantization = "checkpoint-int8" if self.checkpoint_int8 else config.quantization
        prepared = prepare_cpu_weights(self.model, self.dtype, self.device, quantization=quantization,
                                       vocab_size=self.vocab_size, max_num_seqs=config.max_num_seqs,
                                       tensor_parallel=self.tp is not None, batch_invariant=config.deterministic)
        self.lm_head, self.lean = prepared.lm_head, prepared.lean
        if config.deterministic and self.device.type != "cpu":
            # PyTorch's CUDA reductions sum a row by the tensor's shape: RMSNorm row by row in Triton
            from .cuda.invariant_norm import make_norms_batch_invariant

            log.info("deterministic: %d RMSNorms on the row-wise Triton kernel", make_norms_batch_invariant(self.model))
        # what the model's forward does to its head's output (a soft-cap, a scale), since the runner
        # applies the head itself; then one prompt through ferry's path and transformers' own
        # (model/probe.py): a model ferry would compute wrongly is refused here, by name
        self.lm_head = with_output_transform(self.lm_head, self.model, self.hf_config)
        if self.tp is None:
            check_model(self.model, self._step_forward, self.lm_head, self.attn_backend, kv_config, self.kv_dtype,
                        self.block_size, self.max_model_len, self.device, self.dtype,
                        quantized=quantization != "none" or self.kv_dtype == FP8)
        if self.hybrid_kv is not None:
            self._check_windows()
        if quantization != "none":
            self.weight_bytes = _weight_bytes(self.model)
        self.batch = BatchState(self.block_size)
        # CPU: greedy rows' argmax and random rows' draws through the compiled kernels (sampler.py)
        cpu_ops = fused_kernels() if self.device.type == "cpu" else None
        self.sampler = Sampler(self.device, argmax_rows=cpu_ops.argmax_rows if cpu_ops is not None else None,
                               sample_rows=cpu_ops.sample_rows if cpu_ops is not None else None,
                               race_rows=cpu_ops.race_rows if cpu_ops is not None else None,
                               batch_invariant=config.deterministic)
        eos, vocab, model = self.eos_token_ids, self.vocab_size, config.model
        self.constraints = ConstraintTracker(
            lambda: load_tokenizer(tokenizer_dir(resolve_model(model), config.cache_dir), vocab, eos),
            eos_token_ids=eos)
        if self.tp:  # rank 0 alone applies the LM head and samples; the others receive its tokens
            self.lm_head, self.sampler = self.tp.wrap(self.lm_head, self.sampler)
        # CUDA: the step's metadata goes over in one pinned copy, and decode-only steps replay graphs.
        self.staging = StepStaging(self.device) if self.device.type == "cuda" else None
        self.graphs = setup_decode_graphs(self.device, config.enforce_eager, self.attn_backend, self.body,
                                          self.lm_head, self.kv.caches, config.max_num_seqs, self.max_model_len,
                                          self.block_size)

    def _check_windows(self) -> None:
        """The hybrid cache's windowed layers are the ones the probe saw attend through that window:
        any other layer reading a windowed pool would read blocks released behind its window."""
        assert self.hybrid_kv is not None
        want = {i: self.hybrid_kv.window for i in self.hybrid_kv.window_layers}
        seen = dict(self.attn_backend.layer_windows)
        if seen != want:
            arch = ",".join(getattr(self.hf_config, "architectures", None) or [type(self.hf_config).__name__])
            raise ModelRefused(f"{arch}: its layers' sliding windows {seen} are not what its config says {want}; "
                               "ferry cannot lay out its KV cache by window")

    def _kv_budget(self, config_dict: dict) -> int:
        if self.device.type != "cuda":
            return self.config.kv_cache_memory
        # GPU: what gpu_memory_utilization leaves after the weights, a profiled activation peak,
        # the memory outside PyTorch's allocator (CUDA context, cuBLAS, Triton modules; also any
        # other process on the device: conservative) and what the decode graphs will hold.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run(config_dict)
        peak = torch.cuda.max_memory_allocated(self.device)  # weights + the profiled activations
        activations = max(0, peak - self.weight_bytes)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(self.device))
        graphs = 0
        if not self.config.enforce_eager:
            graphs = graph_memory_estimate(graph_batch_sizes(self.config.max_num_seqs), self.vocab_size,
                                           self.dtype.itemsize, activations, self._profile_tokens())
        budget = gpu_kv_budget_bytes(total, self.config.gpu_memory_utilization, self.weight_bytes, activations,
                                     runtime_overhead_bytes=non_torch + graphs)
        log.info("cuda: total %d, weights %d, activation peak %d, outside torch %d, graphs ~%d: KV budget %d bytes",
                 total, self.weight_bytes, activations, non_torch, graphs, budget)
        return budget

    def _profile_tokens(self) -> int:
        return min(self.config.max_num_batched_tokens, self.max_model_len)

    def _profile_run(self, config_dict: dict) -> None:
        """A forward at the step token budget with a one-block scratch cache, for the activation peak."""
        n = self._profile_tokens()
        ids = torch.zeros(1, n, dtype=torch.long, device=self.device)
        backend = select_backend(self.config.attention_backend, self.device)
        if self.config.deterministic:
            backend.make_batch_invariant()
        step, pos, scratch = scratch_prompt(backend, n, config_dict, self.dtype, self.block_size,
                                            self.max_model_len, self.device)
        with torch.inference_mode():  # before the lean forward exists: the model's own body
            hidden = self.body(input_ids=ids, position_ids=pos, use_cache=False, ferry_meta=step).last_hidden_state
            # The sampler's float32 copy and log-softmax of the logits are part of the peak too.
            self.lm_head(hidden[0, -min(n, self.config.max_num_seqs) :]).float().log_softmax(-1)
        del step, scratch
        torch.cuda.synchronize(self.device)

    def _step_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepAttention) -> torch.Tensor:
        """The step's last hidden states [1, T, hidden]: the lean forward where built, else the model's."""
        if self.lean is not None:
            return self.lean(input_ids, positions, step)
        return self.body(input_ids=input_ids, position_ids=positions, use_cache=False,
                         ferry_meta=step).last_hidden_state

    # ------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        self.batch.apply(plan)
        self.constraints.sync(plan)
        if not plan.num_scheduled_tokens:
            return StepResult(step_id=plan.step_id, rank=self.config.rank)
        t0 = time.perf_counter()
        packed = self._pack(plan)
        bucket = self.graphs.bucket_for(packed.batch) if self.graphs is not None else None
        with torch.inference_mode():
            logits = None
            if bucket is not None and self.graphs is not None:  # decode-only: replay, keep sampling rows
                all_logits = self.graphs.run(bucket, packed.input_ids, packed.positions, packed.batch)
                if packed.sample_states:
                    logits = all_logits.index_select(0, packed.sample_token_idx)
            else:
                last = self._step_forward(packed.input_ids, packed.positions, packed.attention)
                if packed.sample_states:
                    hidden = last[0].index_select(0, packed.sample_token_idx)
                    logits = self.lm_head(hidden)  # [num_sampling, vocab]
        t1 = time.perf_counter()
        for req_id, num in plan.num_scheduled_tokens.items():
            self.batch.requests[req_id].num_computed_tokens += num
        states = packed.sample_states
        if logits is None:
            return StepResult(step_id=plan.step_id, rank=self.config.rank, forward_s=t1 - t0)
        constraints = self.constraints.for_step(states)
        with torch.inference_mode():
            tokens, logprobs = self.sampler(
                logits,
                [s.sampling for s in states],
                [s.token_ids for s in states],
                [s.output_counts for s in states],
                [s.num_output_tokens for s in states],
                constraints=constraints,
            )
        if constraints is not None:
            self.constraints.advance(states, tokens)
        for state, token in zip(states, tokens, strict=True):
            state.append_token(token)
        t2 = time.perf_counter()
        return StepResult(
            step_id=plan.step_id,
            rank=self.config.rank,
            req_ids=[s.req_id for s in states],
            sampled_token_ids=tokens,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else [],
            forward_s=t1 - t0,
            sample_s=t2 - t1,
        )

    def _pack(self, plan: StepPlan) -> PackedInputs:
        """The step's tokens, positions and ``PagedBatch``: decodes first, then chunks."""
        decodes: list[RequestState] = []
        chunks: list[tuple[RequestState, int]] = []
        for req_id, num in plan.num_scheduled_tokens.items():
            state = self.batch.requests[req_id]
            if num == 1:
                decodes.append(state)
            else:
                chunks.append((state, num))
        ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_ids: list[list[int]] = []
        window_ids: list[list[int]] = []
        sample_states: list[RequestState] = []
        sample_idx: list[int] = []
        for state, num in [(d, 1) for d in decodes] + chunks:
            start = state.num_computed_tokens
            if num == 1:  # decodes dominate steps: plain ints, no slicing
                ids.append(state.token_ids[start])
            else:
                ids.extend(state.token_ids[start : start + num])
            query_lens.append(num)
            seq_lens.append(start + num)
            block_ids.append(state.block_ids)
            window_ids.append(state.window_block_ids)
            if start + num == state.num_tokens:
                sample_states.append(state)
                sample_idx.append(len(ids) - 1)
        dev = self.device
        if self.staging is not None:  # built on the host, shipped in one pinned non-blocking copy
            host_batch, positions = build_paged_batch(query_lens, seq_lens, block_ids, self.block_size,
                                                      self.max_model_len, torch.device("cpu"))
            batch, (input_ids, pos_t, sample_t) = self.staging.stage_batch(
                host_batch, [np.array([ids], dtype=np.int64), positions[None], np.array(sample_idx, dtype=np.int64)])
        else:
            batch, positions = build_paged_batch(query_lens, seq_lens, block_ids, self.block_size,
                                                 self.max_model_len, dev)
            input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
            pos_t = torch.from_numpy(positions).to(dev).unsqueeze(0)
            sample_t = torch.tensor(sample_idx, dtype=torch.long, device=dev)
        window = None
        if self.hybrid_kv is not None:  # the windowed layers' own tables and slots
            wbatch, _ = build_paged_batch(query_lens, seq_lens, window_ids, self.block_size, self.max_model_len, dev)
            window = WindowStep(frozenset(self.hybrid_kv.window_layers), self.attn_backend.prepare(wbatch), wbatch)
        step = StepAttention(self.attn_backend, self.attn_backend.prepare(batch), self.kv.caches,
                             self.max_model_len, batch, window)
        return PackedInputs(
            input_ids=input_ids,
            positions=pos_t,
            attention=step,
            sample_states=sample_states,
            sample_token_idx=sample_t,
            batch=batch,
        )


def check_deterministic(config: WorkerConfig, backend: str) -> None:
    """Refuse, by name, what ``--deterministic`` cannot keep its promise for (docs/api.md)."""
    if config.device != "cpu" and backend == "reference":
        raise ValueError("--deterministic on a GPU needs the triton attention backend, not 'reference' "
                         "(PyTorch's CUDA reductions pick their blocking by the batch's shape)")


def _weight_bytes(model: torch.nn.Module) -> int:
    """Parameters plus buffers, so int8 packed weights (held outside ``parameters()``) count too."""
    from .model.quantize import packed_weight_bytes

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + packed_weight_bytes(model)


def _eos_ids(config_dict: dict, generation_config: object) -> list[int]:
    ids: list[int] = []
    for source in (getattr(generation_config, "eos_token_id", None), config_dict.get("eos_token_id")):
        if source is None:
            continue
        for t in source if isinstance(source, list) else [source]:
            if int(t) not in ids:
                ids.append(int(t))
    return ids
