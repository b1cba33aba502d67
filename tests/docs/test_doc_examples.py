"""The docs' examples, run: every ``<!-- doctest -->`` block of README.md and docs/*.md
against one ``ferry serve`` on the tiny random model (see tests/docs/examples.py for
the markers).

What is substituted, so a block runs here as an operator would run it there:

- any ``http://127.0.0.1:PORT`` becomes the test cluster's URL (the cluster serves the
  tiny model under the name ``smollm2-135m-instruct``, so request bodies stay as written);
- ``ferry`` is the worktree's ``python -m ferry_cli`` (a shim on PATH), ``.venv/bin/python``
  this interpreter; ``FERRY_REDIS_URL`` points ``ferry keys`` at the cluster's embedded Redis;
- lines that start a server (``make run``, ``ferry serve ...``) are not run, the cluster
  stands in for them; their flags are parsed and validated by ``ferry serve``'s own
  parser and knob checks, so a renamed or out-of-range flag still fails;
- ``--duration N`` of ``ferry bench`` becomes 1 s, ``--duration-s N`` of the overload
  runs 5 s; ``./my-hf-folder`` and the offline engine's model become the tiny model,
  ``/models/llama-3-8b`` a folder with Llama-3-8B's config.json (all ``ferry plan`` reads).

Blocks that add API keys run last: once a key exists, the cluster wants one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.examples import ROOT, Block, all_blocks, missing_output
from tests.integration.conftest import ServeProcess, tail

pytestmark = pytest.mark.slow  # starts a cluster
BLOCK_TIMEOUT_S = 300.0
BENCH_DURATION_S = "1"
OVERLOAD_DURATION_S = "5"
SLOW = os.environ.get("FERRY_DOCS_SLOW", "") == "1"
LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
}


def runnable_blocks() -> list[Block]:
    blocks = [b for b in all_blocks() if b.kind in ("run", "slow")]
    # Keys turn authentication on for every later request: those blocks go last.
    return sorted(blocks, key=lambda b: "ferry keys add" in b.code)


class Workspace:
    """A scratch folder to run examples in, with the substitutions above."""

    def __init__(self, folder: Path, cluster: ServeProcess, tiny_model: Path) -> None:
        self.folder = folder
        self.cluster = cluster
        self.tiny_model = tiny_model
        bin_dir = folder / "bin"
        bin_dir.mkdir()
        shim = bin_dir / "ferry"
        shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m ferry_cli \"$@\"\n")
        shim.chmod(0o755)
        for name in ("loadtests", "tests"):  # examples name paths relative to the repository
            (folder / name).symlink_to(ROOT / name)
        llama = folder / "llama-3-8b"
        llama.mkdir()
        (llama / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "OPENAI_"))}
        env.update(PATH=f"{bin_dir}:{env.get('PATH', '')}", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                   TOKENIZERS_PARALLELISM="false", FERRY_REDIS_URL=f"unix://{cluster.runtime_dir}/redis.sock")
        self.env = env

    def substitute(self, text: str) -> str:
        text = re.sub(r"http://127\.0\.0\.1:\d+", self.cluster.base_url, text)
        text = text.replace(".venv/bin/ferry", "ferry").replace(".venv/bin/python", shlex.quote(sys.executable))
        text = re.sub(r"--duration \d+(\.\d+)?", f"--duration {BENCH_DURATION_S}", text)
        text = re.sub(r"--duration-s \d+(\.\d+)?", f"--duration-s {OVERLOAD_DURATION_S}", text)
        text = text.replace("./my-hf-folder", str(self.tiny_model))
        text = text.replace('LLM(model="smollm2-135m-instruct"', f'LLM(model="{self.tiny_model}"')
        return text.replace("/models/llama-3-8b", str(self.folder / "llama-3-8b"))

    def shell_script(self, block: Block) -> str:
        """The block as a bash script; server lines become a validation of their flags."""
        logical = re.sub(r"\\\n\s*", " ", self.substitute(block.code))
        out = ["set -e"]
        for line in logical.splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["make", "run"]:
                out.append("true  # the test cluster stands in for make run")
            elif words[:2] == ["ferry", "serve"]:
                errors = serve_flag_errors(words[2:])
                assert not errors, f"{block.where}: {line.strip()}\n" + "\n".join(errors)
                out.append("true  # the test cluster stands in for ferry serve (its flags were checked)")
            else:
                out.append(line)
        return "\n".join(out) + "\n"


def serve_flag_errors(argv: list[str]) -> list[str]:
    """What ``ferry serve ARGV`` would refuse before starting anything (argparse errors included)."""
    from ferry_cli.serve import build_parser, knob_errors

    parser = build_parser()
    problems: list[str] = []
    parser.error = lambda message: problems.append(message) or sys.exit(2)  # type: ignore[assignment,method-assign,func-returns-value]
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        return problems or ["ferry serve: the command line does not parse"]
    return knob_errors(args)


@pytest.fixture(scope="module")
def workspace(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    tmp = tmp_path_factory.mktemp("docs")
    cluster = ServeProcess(tiny_model_dir, tmp, ["--served-model-name", "smollm2-135m-instruct"]).start()
    try:
        cluster.wait_ready()
        (tmp / "work").mkdir()
        yield Workspace(tmp / "work", cluster, tiny_model_dir)
    finally:
        cluster.kill()


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: b.where)
def test_doc_example(block: Block, workspace: Workspace) -> None:
    if block.kind == "slow" and not SLOW:
        pytest.skip(f"slow example ({block.reason}); run with FERRY_DOCS_SLOW=1")
    if block.lang == "python":
        cmd = [sys.executable, "-c", workspace.substitute(block.code)]
    else:
        cmd = ["bash", "-c", workspace.shell_script(block)]
    done = subprocess.run(cmd, cwd=workspace.folder, env=workspace.env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    report = f"{block.where} exited {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    assert done.returncode == 0, report
    missing = missing_output([workspace.substitute(line) for line in block.expected], done.stdout)
    assert not missing, f"{block.where}: documented output not found: {missing}\n{report}"


def test_serve_banner_matches_the_docs(workspace: Workspace) -> None:
    """``ferry serve``'s ready banner, as deployment.md shows it (URLs substituted)."""
    banners = [b for b in all_blocks() if b.kind == "serve-output"]
    assert banners, "no <!-- doctest: serve-output --> block in the docs"
    log = tail(workspace.cluster.log_path, 1 << 30)
    for banner in banners:
        expected = [workspace.substitute(ln) for ln in banner.code.splitlines() if ln.strip()]
        missing = missing_output(expected, log)
        assert not missing, f"{banner.where}: banner lines not printed by ferry serve: {missing}\n{log[-3000:]}"
