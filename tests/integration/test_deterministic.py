"""``--deterministic`` end to end in the offline engine (real scheduler, real model runner).

The property (docs/api.md, "Deterministic outputs"): every seeded request's tokens and
logprobs are the bits it gets served alone, whatever the mix around it. Hypothesis draws the
mixes: which requests and in what order (some twice, so the second hits the prefix cache of
the first), the step's token budget and the per-request chunk cap, a KV budget small enough to
preempt or not, prefix caching on or off, and a sibling request served first to warm the cache.
Each backend and dtype: ``cpu_paged`` (the CPU kernels, head size 64 so the prompt kernels
are the default's path) and ``reference`` in float32 and bfloat16, and the Triton kernels under
the interpreter (slow: one fixed mix, in float32). A mix with preemption and prefix hits is checked
for every backend, so the property is never met by a run that exercised neither.

Without ``--deterministic`` the same fixed mix differs from alone (the test could fail), and
greedy decoding with it stays token-exact with transformers in float32.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.device.interpreter import enable_interpreter

HAVE_TRITON = enable_interpreter()  # before anything imports the kernels

from services.engine.offline import LLM, GenerationParams, Output  # noqa: E402
from shared.capacity import kv_block_bytes  # noqa: E402
from tests.conftest import cached_tiny_model  # noqa: E402

BLOCK = 16
MAX_TOKENS = 10
_rng = random.Random(56)
_SHARED = [_rng.randrange(300, 40000) for _ in range(40)]


def _prompt(n: int, shared: int = 0) -> list[int]:
    return _SHARED[:shared] + [_rng.randrange(300, 40000) for _ in range(n)]


PROMPTS = [_prompt(5), _prompt(20, 40), _prompt(57), _prompt(3, 33), _prompt(30), _prompt(12, 17)]
PARAMS = [
    GenerationParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, logprobs=2, ignore_eos=True),
    GenerationParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=12, logprobs=1, ignore_eos=True),
    GenerationParams(max_tokens=MAX_TOKENS, temperature=1.2, top_k=20, seed=13, logprobs=0, ignore_eos=True),
    GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True),  # greedy
    GenerationParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, min_p=0.01, seed=14, logprobs=2,
                     ignore_eos=True),
    GenerationParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=15, presence_penalty=0.5, logprobs=2,
                     ignore_eos=True),
]
UNSEEDED = GenerationParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)  # a neighbour, not checked


@dataclass(frozen=True)
class Mix:
    order: tuple[int, ...]  # PROMPTS indices, in submission order (repeats hit the prefix cache)
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    num_blocks: int
    prefix_caching: bool
    warm: int | None  # a PROMPTS index served first, alone
    neighbours: int  # unseeded requests mixed in


HARD = Mix(order=(2, 1, 3, 0, 5, 4, 1), max_num_batched_tokens=16, long_prefill_token_threshold=8, num_blocks=12,
           prefix_caching=True, warm=3, neighbours=2)


# --kv-cache-dtype and --quantization of the engines _engine builds (test_other_numerics sets them)
NUMERICS = {"kv_cache_dtype": "auto", "quantization": "none"}


def _engine(dtype: str, backend: str, num_blocks: int, deterministic: bool = True, **knobs: object) -> LLM:
    folder = cached_tiny_model("llama-hd64")
    config = json.loads((folder / "config.json").read_text())
    kv_dtype = "fp8" if NUMERICS["kv_cache_dtype"] == "fp8" else dtype
    budget = kv_block_bytes(config, kv_dtype, BLOCK) * num_blocks + 17  # a partial block is dropped
    return LLM(model=str(folder), dtype=dtype, kv_cache_memory=budget, block_size=BLOCK, num_threads=1,
               attention_backend=backend, deterministic=deterministic, **NUMERICS, **knobs)  # type: ignore[arg-type]


def _bits(out: Output) -> tuple[object, ...]:
    return (out.finish_reason, tuple(out.token_ids), repr(out.logprobs))


def _served(dtype: str, backend: str, mix: Mix, deterministic: bool = True) -> tuple[list[Output], LLM]:
    llm = _engine(dtype, backend, mix.num_blocks, deterministic, max_num_batched_tokens=mix.max_num_batched_tokens,
                  long_prefill_token_threshold=mix.long_prefill_token_threshold, max_num_seqs=8,
                  enable_prefix_caching=mix.prefix_caching)
    if mix.warm is not None:
        llm.generate([PROMPTS[mix.warm]], PARAMS[mix.warm], decode=False)
    prompts = [PROMPTS[i] for i in mix.order] + [PROMPTS[(2 * k) % len(PROMPTS)][::-1] for k in range(mix.neighbours)]
    params = [PARAMS[i] for i in mix.order] + [UNSEEDED] * mix.neighbours
    return llm.generate(prompts, params, decode=False)[: len(mix.order)], llm


_ALONE: dict[tuple[str, str], list[tuple[object, ...]]] = {}


def _alone(dtype: str, backend: str) -> list[tuple[object, ...]]:
    """Each request served alone, on an engine with an empty cache and no prefix caching."""
    key = (dtype, backend)
    if key not in _ALONE:
        llm = _engine(dtype, backend, 4096, enable_prefix_caching=False)
        _ALONE[key] = [_bits(llm.generate([p], g, decode=False)[0]) for p, g in zip(PROMPTS, PARAMS, strict=True)]
    return _ALONE[key]


def _check(dtype: str, backend: str, mix: Mix) -> LLM:
    alone = _alone(dtype, backend)
    outs, llm = _served(dtype, backend, mix)
    for i, out in zip(mix.order, outs, strict=True):
        assert _bits(out) == alone[i], f"request {i} in {mix}: other bits than alone"
    return llm


def _backends() -> list[str]:
    from services.worker.backends import select_backend

    names = ["reference"]
    try:
        import torch

        select_backend("cpu_paged", torch.device("cpu"))
        names.insert(0, "cpu_paged")
    except Exception:  # noqa: BLE001 - no C++ compiler: no kernels
        pass
    return names


@pytest.fixture(scope="module", autouse=True)
def _triton_backend() -> Iterator[None]:
    """The Triton kernels as a CPU backend, interpreted (registered for this module's engines)."""
    if HAVE_TRITON:
        from services.worker.backends.base import register_backend
        from services.worker.backends.triton_backend import TritonBackend

        register_backend("triton-interpreted", TritonBackend, ("cpu",))
    yield


MIXES = st.builds(
    Mix,
    order=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=2, max_size=8).map(tuple),
    max_num_batched_tokens=st.sampled_from([8, 16, 24, 64, 512]),
    long_prefill_token_threshold=st.sampled_from([0, 4, 8, 20]),
    num_blocks=st.sampled_from([10, 14, 64]),
    prefix_caching=st.booleans(),
    warm=st.none() | st.integers(0, len(PROMPTS) - 1),
    neighbours=st.integers(0, 3),
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", _backends())
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(mix=MIXES)
def test_any_mix_gives_every_seeded_request_its_bits_alone(backend: str, dtype: str, mix: Mix) -> None:
    _check(dtype, backend, mix)


@pytest.mark.parametrize(("backend", "dtype"), [
    *((b, d) for b in _backends() for d in ("float32", "bfloat16")),
    # the interpreter runs every program in numpy (~30 s a mix): float32 here; its bfloat16
    # attention is checked token by token in tests/unit/worker/test_batch_invariant.py
    ("triton-interpreted", "float32"),
])
def test_a_mix_with_preemption_and_prefix_hits(backend: str, dtype: str) -> None:
    if backend == "triton-interpreted" and not HAVE_TRITON:
        pytest.skip("triton is not installed (pip install -e '.[dev]')")
    llm = _check(dtype, backend, HARD)
    stats = llm.scheduler.stats()
    assert stats.num_preemptions_total > 0, "the KV budget was meant to preempt"
    assert stats.prefix_cache_hits_total > 0, "the repeated prompts were meant to hit the prefix cache"


@pytest.mark.parametrize("numerics", [{"kv_cache_dtype": "fp8"}, {"quantization": "int8"}], ids=["fp8-kv", "int8"])
def test_other_numerics_too(numerics: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A float8 KV cache (every token reads the rounded keys, its own chunk's too) and W8A8 int8
    layers (per-row activation scales, integer sums) under the mix with preemption and hits."""
    if "cpu_paged" not in _backends():
        pytest.skip("the float8 cache needs the CPU kernels")
    monkeypatch.setitem(NUMERICS, "kv_cache_dtype", numerics.get("kv_cache_dtype", "auto"))
    monkeypatch.setitem(NUMERICS, "quantization", numerics.get("quantization", "none"))
    monkeypatch.setattr(sys.modules[__name__], "_ALONE", {})
    llm = _check("bfloat16", "cpu_paged", HARD)
    assert llm.scheduler.stats().num_preemptions_total > 0


@pytest.mark.parametrize("backend", _backends())
def test_without_it_the_same_mix_moves_some_logprobs(backend: str) -> None:
    """The default numerics depend on the mix (what the flag is for; the test above can fail)."""
    alone_llm = _engine("bfloat16", backend, 4096, deterministic=False, enable_prefix_caching=False)
    alone = [_bits(alone_llm.generate([p], g, decode=False)[0]) for p, g in zip(PROMPTS, PARAMS, strict=True)]
    outs, _ = _served("bfloat16", backend, HARD, deterministic=False)
    assert any(_bits(out) != alone[i] for i, out in zip(HARD.order, outs, strict=True))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama-hd64"])
def test_greedy_stays_token_exact_with_transformers(kind: str) -> None:
    from tests.integration.test_offline_tiny import MAX_TOKENS as N
    from tests.integration.test_offline_tiny import PROMPTS as TINY_PROMPTS
    from tests.integration.test_offline_tiny import hf_greedy, tiny_llm

    folder = cached_tiny_model(kind)
    llm = tiny_llm(folder, deterministic=True)
    outs = llm.generate(TINY_PROMPTS, GenerationParams(max_tokens=N, temperature=0.0, ignore_eos=True))
    assert llm.scheduler.stats().num_preemptions_total > 0
    assert [o.token_ids for o in outs] == hf_greedy(folder, TINY_PROMPTS, N)
