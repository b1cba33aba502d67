"""Token constraints: grammars (structured outputs), logit_bias, allowed_token_ids, bad_words.

The sampler calls ``apply_constraints(logits, constraints)`` once, right after the
penalties and before the greedy / random split (docs/architecture.md, seam 2);
``constraints`` is one ``RowConstraint`` (or None: unconstrained) per sampling row,
built by ``ConstraintTracker.for_step``. A batch without constraints costs one
``None`` check; a mixed batch touches only the constrained rows.

Grammar state lives here, per request, in the worker (it has the tokenizer's view
and the logits):

- ``sync(plan)`` runs after the batch state applied a plan: matchers of finished
  or preempted requests are dropped; a new or resumed request with a grammar gets
  its compiled grammar requested from a side thread (``GrammarCache``, once per
  distinct grammar), so compiling overlaps the forward instead of stalling it;
- ``for_step(states)`` waits for those compiles (normally already done), rebuilds
  a request's matcher by replaying its output tokens whenever it was (re)added
  (preemption + recompute, a restarted worker, a prefix-cache hit: the matcher
  depends only on the output tokens, never on how the KV got there), and
  computes each grammar row's allowed-token bitmask;
- ``advance(states, tokens)`` feeds each sampled token to its matcher.

When a grammar has accepted and nothing else may follow, its mask allows only the
model's EOS ids, so the request ends with the EOS the scheduler already stops on
(finish_reason "stop") without the scheduler knowing about grammars.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from shared.grammar import GrammarCache
from shared.messages import SamplingParams, StepPlan

log = logging.getLogger("ferry.worker.constraints")

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer


@dataclass
class RowConstraint:
    """What one sampling row may emit this step."""

    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: Sequence[int] = ()
    banned_token_ids: Sequence[int] = ()
    grammar_bitmask: bytes | None = None  # llguidance: one bit per token id, little-endian


def apply_constraints(logits: torch.Tensor, constraints: Sequence[RowConstraint | None] | None) -> torch.Tensor:
    """Bias and mask ``logits`` [num_rows, vocab] in place (the sampler owns that tensor)."""
    if constraints is None:
        return logits
    vocab = logits.shape[1]
    grammar_rows: list[int] = []
    masks: list[bytes] = []
    for i, c in enumerate(constraints):
        if c is None:
            continue
        row = logits[i]
        if c.logit_bias:
            ids = torch.tensor(list(c.logit_bias.keys()), dtype=torch.long, device=logits.device)
            bias = torch.tensor(list(c.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            row.index_add_(0, ids, bias)
        if c.allowed_token_ids:
            keep = torch.tensor(list(c.allowed_token_ids), dtype=torch.long, device=logits.device)
            kept = row.index_select(0, keep)
            row.fill_(float("-inf"))
            row.index_copy_(0, keep, kept)
        if c.banned_token_ids:
            row.index_fill_(0, torch.tensor(list(c.banned_token_ids), dtype=torch.long, device=logits.device),
                            float("-inf"))
        if c.grammar_bitmask is not None:
            grammar_rows.append(i)
            masks.append(c.grammar_bitmask)
    if grammar_rows:
        # llguidance pads its masks past the vocabulary; every row is cut (or padded) to one width
        width = -(-vocab // 32) * 4
        rows = [m[:width] if len(m) >= width else m + bytes(width - len(m)) for m in masks]
        packed = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), width)
        bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab]
        if bits.shape[1] < vocab:  # ids past the grammar's vocabulary are never allowed
            bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
        forbid = (torch.from_numpy(bits) == 0).to(logits.device)  # [num_grammar_rows, vocab]
        if len(grammar_rows) == logits.shape[0]:
            logits.masked_fill_(forbid, float("-inf"))
        else:
            for j, i in enumerate(grammar_rows):
                logits[i].masked_fill_(forbid[j], float("-inf"))
    return logits


def banned_by_bad_words(bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """vLLM's rule: a bad word's last token is banned when its other tokens were just output."""
    banned: list[int] = []
    for word in bad_words:
        if not word:
            continue
        prefix = list(word[:-1])
        if not prefix or (len(output_token_ids) >= len(prefix) and list(output_token_ids[-len(prefix):]) == prefix):
            banned.append(word[-1])
    return banned


def has_constraints(p: SamplingParams) -> bool:
    return bool(p.grammar or p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids)


class _RequestStateLike(Protocol):
    """What ``for_step`` reads of a worker request (services/worker/batch.py's RequestState)."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams


@dataclass
class _Grammar:
    pending: Future[LLMatcher] | None
    matcher: LLMatcher | None = None
    num_consumed: int = 0  # output tokens fed to the matcher
    failed: bool = False  # the grammar did not compile here: the request may only end


class ConstraintTracker:
    """Per-request grammar matchers of one worker, kept in step with the batch state."""

    def __init__(self, load_tokenizer: Callable[[], LLTokenizer], max_cached_grammars: int = 256,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        # The tokenizer loads (~1 s) in the side thread from start-up, before any grammar needs it.
        self._cache: Future[GrammarCache] = self._executor.submit(
            lambda: GrammarCache(load_tokenizer(), max_cached_grammars))
        self._grammars: dict[str, _Grammar] = {}
        self._fallback_eos = list(eos_token_ids)  # when even the tokenizer view failed to load
        self._eos_ids: list[int] | None = None

    def __len__(self) -> int:
        return len(self._grammars)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def grammar_cache(self) -> GrammarCache:
        return self._cache.result()

    def when_tokenizer_loaded(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` once the start-up tokenizer load has ended (in its thread, or now if it has)."""
        self._cache.add_done_callback(lambda _: callback())

    def sync(self, plan: StepPlan) -> None:
        for req_id in (*plan.finished_req_ids, *plan.preempted_req_ids):
            self._grammars.pop(req_id, None)
        for data in (*plan.new_requests, *plan.resumed_requests):
            self._grammars.pop(data.req_id, None)
            if data.sampling.grammar:
                grammar = data.sampling.grammar
                self._grammars[data.req_id] = _Grammar(
                    self._executor.submit(lambda g=grammar: self._cache.result().matcher(g)))  # type: ignore[misc]

    def for_step(self, states: Sequence[_RequestStateLike]) -> list[RowConstraint | None] | None:
        out: list[RowConstraint | None] | None = None
        for i, s in enumerate(states):
            p = s.sampling
            if not has_constraints(p):
                continue
            if out is None:
                out = [None] * len(states)
            outputs = s.token_ids[s.num_prompt_tokens:]
            row = RowConstraint(logit_bias=p.logit_bias, allowed_token_ids=p.allowed_token_ids,
                                banned_token_ids=banned_by_bad_words(p.bad_words_token_ids, outputs)
                                if p.bad_words_token_ids else ())
            if p.grammar:
                row.grammar_bitmask = self._bitmask(s, outputs)
            out[i] = row
        return out

    def _bitmask(self, s: _RequestStateLike, outputs: Sequence[int]) -> bytes:
        g = self._grammars.get(s.req_id)
        if g is None:  # not announced through sync (a unit test, or a plan this worker missed)
            g = self._grammars[s.req_id] = _Grammar(None)
        if g.failed:
            return self._eos_only()
        if g.matcher is None:
            try:
                g.matcher = g.pending.result() if g.pending is not None else \
                    self._cache.result().matcher(s.sampling.grammar)
            except Exception as e:  # noqa: BLE001 - GrammarError, or the tokenizer view failed to load
                # The gateway compiled it; reaching here means a version skew or a broken tokenizer
                # folder. Failing the step would take the worker (and every request) down, again
                # after each restart: end this request at once instead.
                log.error("request %s: its grammar does not compile here, ending it: %s", s.req_id, e)
                g.failed, g.pending = True, None
                return self._eos_only()
            g.pending = None
            g.num_consumed = 0
        if g.num_consumed != len(outputs):  # (re)added: replay what it already output
            if g.num_consumed > len(outputs):
                g.matcher.reset()
                g.num_consumed = 0
            if not g.matcher.consume_tokens(list(outputs[g.num_consumed:])):
                log.warning("request %s: its output tokens do not fit its grammar: %s", s.req_id,
                            g.matcher.get_error())
            g.num_consumed = len(outputs)
        if g.matcher.is_stopped():  # complete (or broken): it may only end, e.g. EOS kept by min_tokens
            return self._eos_only()
        return bytes(g.matcher.compute_bitmask())

    def _eos_only(self) -> bytes:
        if self._eos_ids is None:
            self._eos_ids = list(self._cache.result().tokenizer.eos_tokens) if self._cache.exception() is None \
                else list(self._fallback_eos)
        bits = np.zeros(-(-(max(self._eos_ids, default=0) + 1) // 32) * 32, dtype=np.uint8)
        bits[self._eos_ids] = 1
        return np.packbits(bits, bitorder="little").tobytes()  # apply_constraints pads it to the vocabulary

    def advance(self, states: Sequence[_RequestStateLike], tokens: Sequence[int]) -> None:
        for s, token in zip(states, tokens, strict=True):
            g = self._grammars.get(s.req_id)
            if g is None or g.matcher is None:
                continue
            if not g.matcher.is_stopped() and not g.matcher.consume_token(token):
                log.warning("request %s: sampled token %d broke its grammar: %s", s.req_id, token,
                            g.matcher.get_error())
            g.num_consumed += 1
