"""Incremental detokenization and stop strings: token ids in, safe text increments out.

Two rules hold for every increment a client sees:

1. **No broken characters.** A byte-level BPE token can end in the middle of a
   UTF-8 character (an emoji is often 3-4 tokens). Text is only released once the
   character is complete; bytes that turn out to be genuinely invalid come out as
   U+FFFD, exactly as a full decode would show them. So the concatenated
   increments equal ``tokenizer.decode(all_ids)``.
2. **Stop strings across tokens.** A stop string may be split over several tokens
   (``"\\n\\n"`` as ``"\\n"`` + ``"\\n"``). The longest tail of the pending text that
   could still become a stop string is held back until it either completes a match
   (the text before it is released, the stop string itself only when asked) or
   can no longer match (it is released).

Byte-level tokenizers get an exact path (each token's bytes through an incremental
UTF-8 decoder). Other tokenizers (SentencePiece-style ``Metaspace`` / ``ByteFallback``)
use the offsets method: decode a short window of recent tokens and release the new
suffix unless it ends in U+FFFD (an unfinished byte-fallback sequence).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

from services.gateway.text.tokenizer import GatewayTokenizer

REPLACEMENT = "\ufffd"
# tokens of context the offsets method decodes before the new ones, so that a
# SentencePiece word-boundary marker on the first new token renders as a space
_CONTEXT_TOKENS = 5


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class ByteLevelDetokenizer:
    """Exact incremental decode for byte-level BPE: bytes -> incremental UTF-8 decoder."""

    def __init__(self, tokenizer: GatewayTokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        return str(self._decoder.decode(self._tok.token_bytes(token_id)))

    def flush(self) -> str:
        """Release whatever is pending (an unfinished character becomes U+FFFD)."""
        return str(self._decoder.decode(b"", final=True))


class OffsetsDetokenizer:
    """Incremental decode for any tokenizer, by decoding a sliding window of tokens."""

    def __init__(self, tokenizer: GatewayTokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = self._clean_context(
            [t for t in prompt_token_ids if t not in tokenizer.special_ids])
        self._prefix_offset = 0  # window start
        self._read_offset = len(self._ids)  # tokens before this are already released

    def _clean_context(self, ids: list[int]) -> list[int]:
        """The last few prompt tokens, cut on whole characters at both ends.

        A window that starts or ends inside a character decodes to U+FFFD (a
        byte-fallback run even turns wholly into U+FFFD when any byte of it is
        invalid), which would garble the first output characters.
        """
        for end in range(len(ids), max(0, len(ids) - _CONTEXT_TOKENS) - 1, -1):
            for start in range(max(0, end - _CONTEXT_TOKENS), max(0, end - 4 * _CONTEXT_TOKENS) - 1, -1):
                if REPLACEMENT not in self._decode(ids[start:end]):
                    return ids[start:end]
        return []

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""  # nothing new yet, or an unfinished multi-byte character
        new_text = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text

    def flush(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""


def make_detokenizer(tokenizer: GatewayTokenizer, prompt_token_ids: Sequence[int] = (),
                     skip_special_tokens: bool = True) -> Detokenizer:
    if tokenizer.is_byte_level:
        return ByteLevelDetokenizer(tokenizer, skip_special_tokens)
    return OffsetsDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)


class StopStringMatcher:
    """Finds stop strings in a stream of text increments, holding back possible prefixes."""

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include_stop_str_in_output
        self._pending = ""
        self.matched: str | None = None

    def _held_length(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def push(self, text: str) -> str:
        """Add text; return what is safe to release. After a match, ``matched`` is set."""
        if self.matched is not None or not text:
            return ""
        pending = self._pending + text
        # Generation stops the moment a stop string is complete, so the match that ENDS
        # first wins (ties: the longer one); that keeps the result independent of how the
        # text was split into increments.
        first: tuple[int, int, str] | None = None
        for stop in self.stops:
            at = pending.find(stop)
            if at >= 0 and (first is None or (at + len(stop), at) < first[:2]):
                first = (at + len(stop), at, stop)
        if first is not None:
            _, at, stop = first
            self.matched = stop
            self._pending = ""
            return pending[:at] + (stop if self.include else "")
        keep = self._held_length(pending)
        self._pending = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def flush(self) -> str:
        """Release the held-back tail when the request ends without a match."""
        out, self._pending = self._pending, ""
        return "" if self.matched is not None else out


class TextStream:
    """One choice's text pipeline: token ids -> detokenizer -> stop strings -> safe increments.

    Stop strings are not checked until ``min_tokens`` tokens were generated
    (vLLM's semantics); ``stopped`` says a stop string ended the text.
    """

    def __init__(self, tokenizer: GatewayTokenizer, prompt_token_ids: Sequence[int], stops: Sequence[str],
                 include_stop_str_in_output: bool = False, min_tokens: int = 0,
                 skip_special_tokens: bool = True) -> None:
        self._detok = make_detokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._matcher = StopStringMatcher(stops, include_stop_str_in_output)
        self._min_tokens = min_tokens
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        return self._matcher.matched is not None

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.num_tokens += 1
        text = self._detok.push(token_id)
        if self.num_tokens <= self._min_tokens:
            # before min_tokens every token's text is released, so no stop may end inside it
            return self._matcher.flush() + text
        return self._matcher.push(text)

    def finish(self) -> str:
        """The rest of the text when the engine finished the request (not after a stop match)."""
        if self.stopped:
            return ""
        tail = self._detok.flush()
        out = self._matcher.push(tail) if tail else ""
        return out + self._matcher.flush()
