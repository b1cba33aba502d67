"""Batched sampling: logits of the requests that sample this step -> one token each.

Order of operations (vLLM's): penalties (repetition on prompt + outputs,
presence / frequency on outputs), then greedy rows take the argmax; random rows
divide by temperature, apply top-k, top-p and min-p, and draw with the
"exponential race" ``argmax(p / E)``, ``E ~ Exp(1)``, which equals sampling from
``p`` but lets each row use its own noise.

Seeds: a seeded request draws its noise from a generator seeded by
``(seed, number of outputs so far)``, so its stream depends neither on the
other requests in the batch nor on preemption (a resumed request regenerates
the same noise for the same output position). Unseeded rows share one
generator.

Logprobs are those of the model's raw distribution (log-softmax of the logits
before penalties and temperature), like vLLM's default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.messages import SampleLogprobs, SamplingParams, TokenLogprob

from .logits_processors import RowConstraint, apply_constraints

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) pairs apart
_MASK63 = (1 << 63) - 1


def seeded_generator(seed: int, num_output_tokens: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(((seed * _SEED_MIX) ^ (num_output_tokens * 0xBF58476D1CE4E5B9 + 1)) & _MASK63)
    return gen


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [num_reqs, vocab]
        params: Sequence[SamplingParams],
        token_ids: Sequence[Sequence[int]],  # prompt + outputs, per row (for penalties)
        output_counts: Sequence[dict[int, int]],  # per row
        num_output_tokens: Sequence[int],
        constraints: Sequence[RowConstraint | None] | None = None,  # per row; None: unconstrained batch
    ) -> tuple[list[int], list[SampleLogprobs | None]]:
        logits = logits.float()
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._apply_penalties(logits, params, token_ids, output_counts)
        logits = apply_constraints(logits, constraints)
        greedy_rows = [i for i, p in enumerate(params) if p.temperature <= 0.0]
        random_rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
        if not random_rows:  # the common all-greedy batch: no row gathering, no copies
            tokens = logits.argmax(dim=-1)
        elif not greedy_rows:
            tokens = self._draw(logits, params, num_output_tokens)
        else:
            tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
            idx = torch.tensor(greedy_rows, device=logits.device)
            tokens[idx] = logits.index_select(0, idx).argmax(dim=-1)
            idx = torch.tensor(random_rows, device=logits.device)
            tokens[idx] = self._draw(
                logits.index_select(0, idx), [params[i] for i in random_rows],
                [num_output_tokens[i] for i in random_rows],
            )
        token_list = tokens.tolist()
        logprobs: list[SampleLogprobs | None] = [None] * len(params)
        if raw_logprobs is not None:
            logprobs = self._logprobs(raw_logprobs, tokens, params)
        return token_list, logprobs

    def _draw(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], num_output_tokens: Sequence[int]
    ) -> torch.Tensor:
        probs = self._probs(logits, params)
        noise = self._noise(probs.shape, params, num_output_tokens)
        return (probs / noise).argmax(dim=-1)

    def _apply_penalties(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        token_ids: Sequence[Sequence[int]],
        output_counts: Sequence[dict[int, int]],
    ) -> torch.Tensor:
        rows = [
            i for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        ]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:  # per row: only rows that asked for penalties, and they are rare
            p = params[i]
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(token_ids[i])), dtype=torch.long, device=logits.device)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if output_counts[i] and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
                ids = torch.tensor(list(output_counts[i].keys()), dtype=torch.long, device=logits.device)
                counts = torch.tensor(list(output_counts[i].values()), dtype=logits.dtype, device=logits.device)
                row[ids] -= p.frequency_penalty * counts + p.presence_penalty
        return logits

    def _probs(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        need_sort = any(k < vocab for k in top_k) or any(p.top_p < 1.0 for p in params)
        if need_sort:
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
            ks = torch.tensor(top_k, device=dev).unsqueeze(1)
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)
            drop = ranks >= ks  # [rows, vocab] in sorted order
            top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev).unsqueeze(1)
            sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= before >= top_p
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=dev).unsqueeze(1)
            keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
            probs = probs * keep
        return probs

    def _noise(self, shape: torch.Size, params: Sequence[SamplingParams], num_outputs: Sequence[int]) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device)
        noise.exponential_(generator=self.generator)
        for i, p in enumerate(params):
            if p.seed is not None:
                gen = seeded_generator(p.seed, num_outputs[i], self.device)
                noise[i].exponential_(generator=gen)
        return noise

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]
    ) -> list[SampleLogprobs | None]:
        sampled = raw.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        max_top = max((p.logprobs or 0) for p in params)
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if max_top > 0:
            vals, ids = raw.topk(max_top, dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        out: list[SampleLogprobs | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            top = [TokenLogprob(top_ids[i][j], top_vals[i][j]) for j in range(p.logprobs)] if p.logprobs else []
            out.append(SampleLogprobs(TokenLogprob(int(tokens[i]), sampled[i]), top))
        return out
