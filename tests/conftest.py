"""Fixtures shared by every test tier: the tiny random-weight model, cached on disk.

Building the tiny model imports torch and transformers (seconds), so the folder is
written once into ``~/.cache/ferry/test-models/<kind>-<hash>`` (keyed by the builder's
source, so a change to tests/tiny_models.py builds a fresh one) and reused by later
sessions. It is built in a child process: the test process need not import torch.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_BUILD = """
import sys
from pathlib import Path
from tests.tiny_models import build_tiny_model
build_tiny_model(Path(sys.argv[1]), sys.argv[2])
"""


def cached_tiny_model(kind: str = "llama") -> Path:
    """The tiny model folder for ``kind``, built on first use (atomically, race-safe)."""
    source = (ROOT / "tests" / "tiny_models.py").read_bytes()
    key = hashlib.sha256(source + kind.encode()).hexdigest()[:12]
    base = Path(os.environ.get("FERRY_TEST_CACHE", Path.home() / ".cache" / "ferry" / "test-models"))
    folder = base / f"{kind}-{key}"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=base))
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-c", _BUILD, str(tmp / "m"), kind], cwd=ROOT, env=env,
                       check=True, timeout=300)
        try:
            os.rename(tmp / "m", folder)
        except OSError:  # another session won the race: use its folder
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A tiny random-weight Llama (real SmolLM2 tokenizer and chat template)."""
    return cached_tiny_model("llama")
