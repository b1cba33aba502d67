"""Text of an exact token length for the target model's tokenizer.

Prompt lengths in a load test only mean something in the server's own tokens:
a "1000-token prompt" measured in words or characters is a different workload
for every tokenizer. So the generator loads the target model's tokenizer
(``--tokenizer``: a built-in model name, a model folder, a GGUF file or a
folder holding ``tokenizer.json``) and builds text from a seeded pool of words
that are single tokens in that vocabulary, then checks the final count by
encoding it, adjusting word by word until it is exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

DEFAULT_TOKENIZER = "smollm2-135m-instruct"


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (fast, no transformers import) without special tokens."""

    backend: Any
    name: str

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=False))

    def vocab(self) -> list[str]:
        return [self.decode([i]) for i in range(self.backend.get_vocab_size())]


def tokenizer_folder(name: str) -> Path:
    """Where the tokenizer for ``name`` lives: a folder with tokenizer.json."""
    path = Path(name).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path
    from shared.models import resolve_model, tokenizer_dir

    return tokenizer_dir(resolve_model(name))


def load_tokenizer(name: str = DEFAULT_TOKENIZER) -> HFTokenizer:
    from tokenizers import Tokenizer as RustTokenizer

    folder = tokenizer_folder(name)
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"tokenizer {name!r}: {folder} has no tokenizer.json")
    return HFTokenizer(RustTokenizer.from_file(str(file)), name)


def word_pool(tokenizer: HFTokenizer, size: int = 2048, seed: int = 0) -> list[str]:
    """Seeded choice of alphabetic words that encode to exactly one token after a space."""
    candidates = sorted(
        {
            piece.strip()
            for piece in tokenizer.vocab()
            if piece.startswith(" ") and piece[1:].isalpha() and piece[1:].isascii() and piece[1:].islower()
            and 3 <= len(piece) <= 11
        }
    )
    rng = random.Random(seed)
    rng.shuffle(candidates)
    pool: list[str] = []
    for word in candidates:
        if len(tokenizer.encode(" " + word)) == 1 and len(tokenizer.encode("x " + word)) == 2:
            pool.append(word)
            if len(pool) >= size:
                break
    if len(pool) < 64:
        raise ValueError(f"tokenizer {tokenizer.name!r}: too few single-token words to build prompts")
    return sorted(pool)


class TextBuilder:
    """Builds seeded word text of an exact token count."""

    def __init__(self, tokenizer: HFTokenizer, pool_seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.pool = word_pool(tokenizer, seed=pool_seed)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def text(self, num_tokens: int, rng: random.Random) -> str:
        """Text that encodes to exactly ``num_tokens`` tokens (no special tokens)."""
        if num_tokens < 1:
            raise ValueError("num_tokens must be at least 1")
        words = [rng.choice(self.pool) for _ in range(num_tokens)]
        # Word-per-token holds almost always; the loop fixes the rare boundary merge.
        for _ in range(8 + num_tokens // 8):
            text = " ".join(words)
            n = self.count(text)
            if n == num_tokens:
                return text
            if n > num_tokens and len(words) > 1:
                del words[max(1, len(words) - (n - num_tokens)) :]
            elif n > num_tokens:
                # A lone first word (no leading space) may split in two: try another.
                words = [rng.choice(self.pool)]
            else:
                words += [rng.choice(self.pool) for _ in range(num_tokens - n)]
        raise ValueError(f"could not build text of exactly {num_tokens} tokens with {self.tokenizer.name!r}")
