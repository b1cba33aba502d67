"""The gateway's tokenizer: encode, decode, special tokens and the chat template, without torch.

``transformers.AutoTokenizer`` imports torch (seconds of start-up and hundreds of
MiB the gateway never uses), so the gateway reads a converted tokenizer folder
(``tokenizer.json`` + ``tokenizer_config.json`` + the chat template) with the
``tokenizers`` library and renders the chat template with jinja2 in a sandbox,
the way transformers does. A GGUF model is converted into that folder once, in a
child process, so not even the first start of a gateway pays for torch.

For byte-level BPE tokenizers (GPT-2 style ``ByteLevel`` decoder: Llama 3, Qwen,
SmolLM) ``token_bytes`` gives the exact bytes each token stands for, which the
incremental detokenizer uses to cut text on UTF-8 character boundaries.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from shared.models import ModelSource, converted_root, resolve_model


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (a 400 for the client)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in _bytes_to_unicode().items()}


def _token_content(value: Any) -> str | None:
    """tokenizer_config's special tokens are strings or AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _find_chat_template(folder: Path, tok_config: Mapping[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    if isinstance(template, str):
        return template
    side_file = _read_json(folder / "chat_template.json").get("chat_template")
    return side_file if isinstance(side_file, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which chat templates do not expect
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class GatewayTokenizer:
    """Everything the gateway needs to know about a model's vocabulary."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok_config = _read_json(folder / "tokenizer_config.json")
        model_config = _read_json(folder / "config.json")
        gen_config = _read_json(folder / "generation_config.json")
        self.chat_template = _find_chat_template(folder, tok_config)
        self.special_tokens: dict[str, str] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            content = _token_content(tok_config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        added = self.tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.eos_token_ids = self._eos_ids(model_config, gen_config)
        tok_vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        # the model's embedding may be padded beyond the tokenizer's vocabulary
        self.vocab_size = max(int(model_config.get("vocab_size") or 0), tok_vocab)
        self.max_position_embeddings = int(model_config.get("max_position_embeddings") or 0)
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        self.is_byte_level = decoder.get("type") == "ByteLevel"
        self._bytes_cache: dict[int, bytes] = {}

    def _eos_ids(self, model_config: Mapping[str, Any], gen_config: Mapping[str, Any]) -> list[int]:
        ids: set[int] = set()
        for source in (gen_config.get("eos_token_id"), model_config.get("eos_token_id")):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(i for i in source if isinstance(i, int))
        eos = self.special_tokens.get("eos_token")
        if eos is not None:
            eos_id = self.tokenizer.token_to_id(eos)
            if eos_id is not None:
                ids.add(eos_id)
        return sorted(ids)

    # -- encode / decode -------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token contributes (byte-level tokenizers only)."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        piece = self.tokenizer.id_to_token(token_id) or ""
        try:
            raw = bytes(CHAR_TO_BYTE[c] for c in piece)
        except KeyError:  # like the ByteLevel decoder: a piece outside the map is taken as-is
            raw = piece.encode("utf-8")
        self._bytes_cache[token_id] = raw
        return raw

    def token_text(self, token_id: int) -> str:
        """A display string for one token (logprobs), special tokens included."""
        if self.is_byte_level and token_id not in self.special_ids:
            return self.token_bytes(token_id).decode("utf-8", errors="replace")
        return self.decode([token_id], skip_special_tokens=False)

    # -- chat ------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(kwargs)
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from e


_CONVERT_SNIPPET = (
    "import sys\n"
    "from pathlib import Path\n"
    "from shared.models import resolve_model, tokenizer_dir\n"
    "print(tokenizer_dir(resolve_model(sys.argv[1]), sys.argv[2]))\n"
)


def gateway_tokenizer_dir(model: str, cache_dir: str = "") -> Path:
    """The converted tokenizer folder of ``model``, converting a GGUF in a child process.

    The conversion goes through transformers (and so torch); running it in a child
    keeps the gateway process itself free of torch even on the very first start.
    """
    source: ModelSource = resolve_model(model)
    if source.kind == "hf_dir":
        if not (source.path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{source.path} has no tokenizer.json (a fast tokenizer); the gateway needs one")
        return source.path
    final = converted_root(source, cache_dir) / "tokenizer"
    if not (final / "tokenizer.json").is_file():
        root = Path(__file__).resolve().parents[2]
        proc = subprocess.run([sys.executable, "-c", _CONVERT_SNIPPET, model, cache_dir],
                              cwd=root, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"converting the tokenizer of {model!r} failed:\n{proc.stderr[-2000:]}")
    return final


def load_gateway_tokenizer(model: str, cache_dir: str = "") -> GatewayTokenizer:
    return GatewayTokenizer(gateway_tokenizer_dir(model, cache_dir))
