"""Batched sampling: logits of the requests that sample this step -> one token each.

Order of operations (vLLM's): penalties (repetition on prompt + outputs,
presence / frequency on outputs), then token constraints (seam 2, see
``Sampler.__call__``), then greedy rows take the argmax; random rows divide by
temperature, apply top-k, top-p and min-p, and draw with the "exponential race"
``argmax(p / E)``, ``E = -log U ~ Exp(1)``, which equals sampling from ``p`` but
lets each row use its own noise.

Speed (a 49,152-token vocabulary, several rows per step): no full sort. Rows with
top-k or top-p work on a candidate set from one ``topk``: a top-k row's own k best
tokens; a top-p row's best ``TOP_P_CANDIDATES``, which is exact whenever they hold
at least ``top_p`` of the mass (checked per row; a row where they do not falls back
to the whole vocabulary). Noise is drawn only over a row's candidates, as uniforms
(``uniform_`` then ``-log``: several times cheaper than ``exponential_``).

Seeds: a seeded request's noise for output position k comes from ``(seed, k)`` alone and
belongs to each token (column j of a whole-vocabulary row is token j's; a candidate row
gathers its tokens' draws from a vocabulary-wide one), so its stream depends neither on the
other requests in the batch nor on preemption, and a resumed request (its KV recomputed,
its logits a few ulps away from the first run's) changes its pick only where the winner
itself was within those ulps of a contender. Unseeded rows share one generator.

Logprobs are those of the model's raw distribution (log-softmax of the logits
before penalties and temperature), like vLLM's default.

On the CPU, with the compiled kernels, unseeded random rows are drawn by inverse CDF in
``sample_rows`` instead: one uniform per row rather than one per vocabulary token, and top-k,
top-p and min-p as thresholds on the row's ``exp((x - max) / T)`` found by bisection, without
a sort or ``topk`` (64 rows of a 49,152-token vocabulary: 32-48 ms of CPU -> 3-5 ms). Same
distributions, except that a token tied with the last one a filter keeps is kept too. The
inverse CDF is no good for seeds: its pick moves whenever any earlier token's mass or the
top-p cut moves by a last bit (2 of 1,000 flat 49,152-token rows under a 1e-6 relative
change of the logits; none for the race). Seeded rows go to ``race_rows``: the same thresholds, then the race with each
token's noise hashed from (seed key, token id) in the kernel. The token a given seed picks
differs between the kernels and the PyTorch race.

A batch with nothing to apply before the draw (no penalties, constraints or logprobs; the
common load's every step, greedy or sampled) skips the float32 copy: greedy rows take their
argmax straight from the LM head's logits through ``argmax_rows`` (the CPU kernels'
``argmax_rows``: torch.argmax's answer, ties and NaNs included, without its scalar
reduction) and random rows go to the kernels as they are (they widen bfloat16 themselves).
Both measured in docs/benchmarks.md, "Sampling".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shared.messages import SampleLogprobs, SamplingParams, TokenLogprob

from .logits_processors import RowConstraint, apply_constraints

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) pairs apart
_MASK63 = (1 << 63) - 1


def seed_key(seed: int, num_output_tokens: int) -> int:
    """A seeded request's key for one output position: 63 bits, spread apart for nearby pairs."""
    return ((seed * _SEED_MIX) ^ (num_output_tokens * 0xBF58476D1CE4E5B9 + 1)) & _MASK63


def seeded_generator(seed: int, num_output_tokens: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_key(seed, num_output_tokens))
    return gen


ARGMAX_DTYPES = (torch.bfloat16, torch.float32)


class Sampler:
    def __init__(
        self, device: torch.device, seed: int = 0, argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
        sample_rows: Callable[..., torch.Tensor] | None = None,
        race_rows: Callable[..., torch.Tensor] | None = None, batch_invariant: bool = False,
    ) -> None:
        self.device = device
        # --deterministic: the PyTorch race draws each row alone, since its candidate rows share
        # one width (the widest row's) and their sums run over it (the kernels' rows are their own)
        self.batch_invariant = batch_invariant
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # [rows, vocab] bfloat16/float32 CPU logits -> int64 [rows], as torch.argmax(dim=-1)
        self.argmax_rows = argmax_rows
        # (logits [rows, vocab], float32 1/temperature, int64 top_k, float32 top_p, float32 min_p,
        # float32 uniforms, each [rows]) -> int64 [rows]: the CPU kernels' inverse-CDF draw
        self.sample_rows = sample_rows
        # the same with int64 keys for the uniforms: the seeded rows' exponential race, its noise
        # keyed by (key, token id)
        self.race_rows = race_rows

    def _plain(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               constraints: Sequence[RowConstraint | None] | None) -> bool:
        """Nothing to apply before the draw (no penalties, constraints or logprobs), CPU logits
        the kernels read, and a kernel for each kind of row in the batch."""
        if not (logits.device.type == "cpu" and logits.dtype in ARGMAX_DTYPES and logits.dim() == 2
                and logits.is_contiguous() and logits.shape[1] > 0
                and (constraints is None or all(c is None for c in constraints))
                and all(p.logprobs is None and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
                        and p.frequency_penalty == 0.0 for p in params)):
            return False
        greedy = any(p.temperature <= 0.0 for p in params)
        random = any(p.temperature > 0.0 for p in params)
        return (not greedy or self.argmax_rows is not None) and (not random or self.sample_rows is not None)

    def __call__(
        self,
        logits: torch.Tensor,  # [num_reqs, vocab]
        params: Sequence[SamplingParams],
        token_ids: Sequence[Sequence[int]],  # prompt + outputs, per row (for penalties)
        output_counts: Sequence[dict[int, int]],  # per row
        num_output_tokens: Sequence[int],
        constraints: Sequence[RowConstraint | None] | None = None,  # per row; None: unconstrained batch
    ) -> tuple[list[int], list[SampleLogprobs | None]]:
        if self._plain(logits, params, constraints):
            return self._plain_tokens(logits, params, num_output_tokens), [None] * len(params)
        logits = logits.float()
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._apply_penalties(logits, params, token_ids, output_counts)
        # Seam 2 (SEAMS.md): token constraints apply HERE, after penalties and before the
        # greedy/random split, as one call.
        logits = apply_constraints(logits, constraints)
        tokens = self._tokens(logits, params, num_output_tokens, _torch_argmax)
        token_list = tokens.tolist()
        logprobs: list[SampleLogprobs | None] = [None] * len(params)
        if raw_logprobs is not None:
            logprobs = self._logprobs(raw_logprobs, tokens, params)
        return token_list, logprobs

    def _plain_tokens(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                      num_output_tokens: Sequence[int]) -> list[int]:
        """The kernels straight on the LM head's logits: no float32 copy. The kernels widen
        bfloat16 to float32 exactly, so every token is the one the float32 path draws (the same
        uniforms, taken for the random rows in the same order)."""
        argmax = self.argmax_rows
        assert argmax is not None or all(p.temperature > 0.0 for p in params)  # _plain saw to it
        return self._tokens(logits, params, num_output_tokens, argmax or _torch_argmax).tolist()

    def _tokens(self, logits: torch.Tensor, params: Sequence[SamplingParams], num_output_tokens: Sequence[int],
                argmax: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Greedy rows through ``argmax``, random rows through ``_draw``; an all-greedy or
        all-random batch (the common cases) without gathering rows."""
        greedy_rows = [i for i, p in enumerate(params) if p.temperature <= 0.0]
        random_rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
        if not random_rows:
            return argmax(logits)
        if not greedy_rows:
            return self._draw(logits, params, num_output_tokens)
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        idx = torch.tensor(greedy_rows, device=logits.device)
        tokens[idx] = argmax(logits.index_select(0, idx))
        idx = torch.tensor(random_rows, device=logits.device)
        tokens[idx] = self._draw(logits.index_select(0, idx), [params[i] for i in random_rows],
                                 [num_output_tokens[i] for i in random_rows])
        return tokens

    def _draw(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], num_output_tokens: Sequence[int]
    ) -> torch.Tensor:
        """One token per row (all rows random): through the CPU kernels when the worker has them
        (``sample_rows`` for unseeded rows, ``race_rows`` for seeded ones), else the exponential race."""
        sample_rows = self.sample_rows
        if sample_rows is None or logits.device.type != "cpu" or logits.dtype not in ARGMAX_DTYPES:
            return self._race(logits, params, num_output_tokens)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if not seeded:
            return sample_rows(logits.contiguous(), *self._filters(params, logits.shape[1]),
                               torch.rand(len(params), generator=self.generator))
        if len(seeded) == len(params):
            return self._draw_seeded(logits, params, num_output_tokens)
        plain = [i for i, p in enumerate(params) if p.seed is None]
        tokens = torch.empty(len(params), dtype=torch.long)
        for rows, draw in ((plain, self._draw), (seeded, self._draw_seeded)):
            idx = torch.tensor(rows)
            tokens[idx] = draw(logits.index_select(0, idx), [params[i] for i in rows],
                               [num_output_tokens[i] for i in rows])
        return tokens

    def _draw_seeded(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], num_output_tokens: Sequence[int]
    ) -> torch.Tensor:
        """Seeded CPU rows: the race with each token's noise keyed by (seed, position, token id),
        in ``race_rows`` when the worker has it."""
        if self.race_rows is None:
            return self._race(logits, params, num_output_tokens)
        keys = torch.tensor([seed_key(p.seed or 0, n) for p, n in zip(params, num_output_tokens, strict=True)],
                            dtype=torch.long)
        return self.race_rows(logits.contiguous(), *self._filters(params, logits.shape[1]), keys)

    @staticmethod
    def _filters(params: Sequence[SamplingParams], vocab: int) -> tuple[torch.Tensor, ...]:
        """The kernels' per-row 1/temperature, top-k (0: off), top-p and min-p."""
        f32 = torch.float32
        return (torch.tensor([1.0 / p.temperature for p in params], dtype=f32),
                torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params], dtype=torch.long),
                torch.tensor([p.top_p for p in params], dtype=f32),
                torch.tensor([p.min_p for p in params], dtype=f32))

    def _race(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], num_output_tokens: Sequence[int]
    ) -> torch.Tensor:
        """The exponential race: candidate rows and whole-vocabulary rows apart."""
        if self.batch_invariant and len(params) > 1:
            return torch.cat([self._race(logits[i : i + 1], [params[i]], [num_output_tokens[i]])
                              for i in range(len(params))])
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[1]
        widths = [_candidate_width(p, vocab) for p in params]
        tokens = torch.empty(len(params), dtype=torch.long, device=dev)
        full = [i for i, w in enumerate(widths) if w >= vocab]
        cand = [i for i, w in enumerate(widths) if w < vocab]
        if cand:
            rows = torch.tensor(cand, device=dev) if full else None
            sub = logits if rows is None else logits.index_select(0, rows)
            picked, fell_back = self._draw_candidates(
                sub, [params[i] for i in cand], [widths[i] for i in cand], [num_output_tokens[i] for i in cand]
            )
            if rows is None:
                tokens = picked
            else:
                tokens[rows] = picked
            full = sorted(full + [cand[j] for j in fell_back])
        if full:
            rows = torch.tensor(full, device=dev)
            sub = logits.index_select(0, rows)
            sub_params = [params[i] for i in full]
            probs = _min_p(self._sorted_filter(sub, sub_params).softmax(dim=-1), sub_params)
            noise = self._noise(probs.shape, sub_params, [vocab] * len(full), [num_output_tokens[i] for i in full])
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens

    def _draw_candidates(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], widths: Sequence[int],
        num_outputs: Sequence[int],
    ) -> tuple[torch.Tensor, list[int]]:
        """Rows whose filters keep at most ``widths[i]`` tokens: top-k, then top-p inside it,
        then min-p, then the race, all on the sorted candidates. Also returns the rows where
        top-p needs more than the candidates (they must be drawn over the whole vocabulary)."""
        dev = logits.device
        width = max(widths)
        vals, idx = logits.topk(width, dim=-1)  # sorted, best first
        ranks = torch.arange(width, device=dev).unsqueeze(0)
        drop = ranks >= torch.tensor(widths, device=dev).unsqueeze(1)
        has_k = torch.tensor([0 < p.top_k < logits.shape[1] for p in params], device=dev).unsqueeze(1)
        # top-p is over the top-k renormalized distribution, or over the whole vocabulary.
        masked = vals.masked_fill(drop, float("-inf"))
        log_norm = torch.where(has_k, masked.logsumexp(dim=-1, keepdim=True), logits.logsumexp(dim=-1, keepdim=True))
        probs = (masked - log_norm).exp()  # [rows, width], zero where dropped
        top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=dev).unsqueeze(1)
        cum = probs.cumsum(dim=-1)
        # Without top-k, the candidates are exact only if they reach top_p.
        short = (~has_k[:, 0]) & (cum[:, -1] < top_p[:, 0])
        drop |= (cum - probs) >= top_p  # keep the smallest prefix reaching top_p
        drop[:, 0] = False  # the top token always stays
        probs = _min_p(probs.masked_fill(drop, 0.0), params)
        noise = self._noise(probs.shape, params, widths, num_outputs, idx, logits.shape[1])
        picked = idx.gather(1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(1)
        return picked, [int(i) for i in short.nonzero().flatten().tolist()]

    @staticmethod
    def _sorted_filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Top-p over the whole vocabulary by a full sort: only rows the candidates cannot serve."""
        if all(p.top_p >= 1.0 for p in params):
            return logits
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device).unsqueeze(1)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop[:, 0] = False
        return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits.masked_fill(drop, float("-inf")))

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

    def _noise(
        self, shape: torch.Size, params: Sequence[SamplingParams], widths: Sequence[int], num_outputs: Sequence[int],
        token_ids: torch.Tensor | None = None, vocab: int = 0,
    ) -> torch.Tensor:
        """Exp(1) noise as ``-log U``. A seeded row's noise comes from its own generator and
        belongs to the token: column j is the draw for token j, or for ``token_ids[i, j]`` when
        the columns are a row's sorted candidates (then ``vocab`` wide is drawn and gathered), so
        two near-tied candidates that swap ranks under a last-bit change keep their own noise.
        Columns past ``widths[i]`` are masked out by the caller."""
        noise = torch.empty(shape, device=self.device)
        noise.uniform_(generator=self.generator)
        for i, p in enumerate(params):
            if p.seed is None:
                continue
            gen = seeded_generator(p.seed, num_outputs[i], self.device)
            if token_ids is None:
                noise[i, : widths[i]].uniform_(generator=gen)
            else:
                row = torch.empty(vocab, device=self.device).uniform_(generator=gen)
                noise[i, : widths[i]] = row[token_ids[i, : widths[i]]]
        return noise.log_().neg_()

    @staticmethod
    def _logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]
    ) -> list[SampleLogprobs | None]:
        sampled = raw.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        max_top = max((p.logprobs or 0) for p in params)
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if max_top > 0:
            top_vals, top_ids = _top_by_id(raw, max_top)
        out: list[SampleLogprobs | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            top = [TokenLogprob(top_ids[i][j], top_vals[i][j]) for j in range(p.logprobs)] if p.logprobs else []
            out.append(SampleLogprobs(TokenLogprob(int(tokens[i]), sampled[i]), top))
        return out


TOP_P_CANDIDATES = 1024  # a top-p row's candidate set; rows whose top 1024 hold < top_p fall back


def _top_by_id(raw: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Each row's ``k`` best (value, token id), ties listed by token id. ``topk`` orders (and at
    the k-th place picks among) tied values as its kernel's split of the rows falls, which moves
    with the number of rows (bfloat16 logits tie often), so a request's top logprobs would
    depend on its batch. Within the k, ties are put in id order by two sorts over [rows, k];
    only a row whose k-th value ties with a value left out is redone over all its candidates."""
    vals, ids = raw.topk(k, dim=-1)
    by_id = ids.sort(dim=-1)
    by_value = vals.gather(1, by_id.indices).sort(dim=-1, descending=True, stable=True).indices
    vals, ids = vals.gather(1, by_id.indices).gather(1, by_value), by_id.values.gather(1, by_value)
    kth = vals[:, -1:]
    at_edge = ((raw == kth).sum(-1) > (vals == kth).sum(-1)).nonzero().flatten().tolist()
    out_vals, out_ids = vals.tolist(), ids.tolist()
    for r in at_edge:  # the k-th place is a tie that runs past k: the lowest ids win it
        row = raw[r]
        cand = (row >= kth[r]).nonzero().flatten()  # ascending token ids
        order = torch.sort(row[cand], descending=True, stable=True).indices[:k]
        out_vals[r], out_ids[r] = row[cand[order]].tolist(), cand[order].tolist()
    return out_vals, out_ids


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _candidate_width(p: SamplingParams, vocab: int) -> int:
    """How many of a row's best tokens its filters can keep (``vocab``: no bound)."""
    if 0 < p.top_k < vocab:
        return p.top_k
    if p.top_p < 1.0:
        return min(TOP_P_CANDIDATES, vocab)
    return vocab


def _min_p(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Zero the tokens below ``min_p`` times the row's best probability."""
    if all(p.min_p <= 0.0 for p in params):
        return probs
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device).unsqueeze(1)
    return probs * (probs >= min_p * probs.max(dim=-1, keepdim=True).values)
