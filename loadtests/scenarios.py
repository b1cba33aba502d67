"""Built-in traffic scenarios: seeded generators that write traces.

The three seed traffic groups of the method, plus their mix:

- ``chat``: short prompts, short answers, some multi-turn conversations;
  Poisson arrivals.
- ``long-context``: large prefills (thousands of tokens), moderate outputs.
- ``agent-rag``: a few shared prefixes (a retrieved document or tool list)
  reused by many requests, varied output lengths, clients that cancel after a
  random number of tokens, and arrivals in bursts.
- ``mixed``: the three interleaved, each with its own timed arrivals.
- ``fixed``: every request the same prompt and output length (200 and 64 tokens
  unless overridden), plain /v1/completions prompts: for side-by-side runs of two
  servers on identical arithmetic (``make bench-peers``).
- ``smoke``: a bit of everything, small (short prompts, 4-16 output tokens,
  two shared prefixes, some cancellations, small bursts): a quick check that a
  server and the whole tool work, on any hardware.

Every trace is made at a nominal rate of 1 request/second; the ``trace``
arrival process scales those offsets to the offered rate, the others replace
them. Lengths are log-uniform in a range (short requests are common, long
ones rare) and exact in the target tokenizer's tokens. The same scenario,
seed, options and tokenizer always give the same trace and content hash.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from loadtests.textgen import TextBuilder
from loadtests.trace import Trace, TraceRequest

Range = tuple[int, int]


@dataclass(frozen=True)
class ScenarioOptions:
    prompt_tokens: Range
    """Tokens of the unique part of the prompt (log-uniform in the range)."""
    output_tokens: Range
    """max_tokens of each request (log-uniform in the range)."""
    prefix_tokens: Range = (0, 0)
    """Tokens of the shared prefix, one length per prefix group."""
    num_prefix_groups: int = 0
    """Distinct shared prefixes (0: no shared prefix)."""
    cancel_fraction: float = 0.0
    """Share of requests the client cancels after a random number of tokens."""
    burst_size: Range = (1, 1)
    """Requests per burst; (1, 1) means plain Poisson arrivals."""
    burst_spread_s: float = 0.2
    """A burst's requests arrive within this many seconds (at the nominal rate)."""
    multi_turn_fraction: float = 0.0
    """Share of requests that carry an earlier user/assistant turn."""
    completions: bool = False
    """Send a plain ``prompt`` to /v1/completions (no chat template adds tokens) instead of messages."""


SCENARIOS: dict[str, ScenarioOptions] = {
    "chat": ScenarioOptions(prompt_tokens=(16, 256), output_tokens=(16, 128), multi_turn_fraction=0.3),
    "long-context": ScenarioOptions(prompt_tokens=(1024, 3072), output_tokens=(64, 256)),
    "agent-rag": ScenarioOptions(
        prompt_tokens=(16, 96),
        output_tokens=(8, 256),
        prefix_tokens=(512, 1024),
        num_prefix_groups=4,
        cancel_fraction=0.2,
        burst_size=(2, 8),
    ),
}
# Fixed lengths for side-by-side runs (the peer boards' common load): every request a distinct
# 200-token plain prompt and 64 output tokens (with ignore_eos), so two servers do the
# same arithmetic and a GEMM limit can be computed for the trace.
SCENARIOS["fixed"] = ScenarioOptions(prompt_tokens=(200, 200), output_tokens=(64, 64), completions=True)
SCENARIOS["smoke"] = ScenarioOptions(
    prompt_tokens=(8, 64), output_tokens=(4, 16), prefix_tokens=(32, 64), num_prefix_groups=2,
    cancel_fraction=0.2, burst_size=(1, 3),
)
MIXED_SHARES: dict[str, float] = {"chat": 0.6, "long-context": 0.15, "agent-rag": 0.25}
SCENARIO_NAMES = [*SCENARIOS, "mixed"]


def parse_overrides(items: list[str]) -> dict[str, object]:
    """``key=value`` strings to option values: ``prompt_tokens=32:64``, ``cancel_fraction=0.5``."""
    fields = {f.name: f.type for f in dataclasses.fields(ScenarioOptions)}
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ValueError(f"scenario option {item!r}: expected key=value with key one of {', '.join(fields)}")
        try:
            if "bool" in str(fields[key]):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(f"expected true or false, got {value!r}")
                out[key] = value.lower() in ("true", "1")
            elif "Range" in str(fields[key]):
                lo, _, hi = value.partition(":")
                out[key] = (int(lo), int(hi or lo))
            elif "int" in str(fields[key]):
                out[key] = int(value)
            else:
                out[key] = float(value)
        except ValueError as exc:
            raise ValueError(f"scenario option {item!r}: {exc}") from exc
    return out


def scenario_options(name: str, overrides: dict[str, object] | None = None) -> ScenarioOptions:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIO_NAMES)}")
    options = dataclasses.replace(SCENARIOS[name], **(overrides or {}))  # type: ignore[arg-type]
    for label, (lo, hi) in (("prompt_tokens", options.prompt_tokens), ("output_tokens", options.output_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"scenario {name}: {label} must be a range 1 <= lo <= hi, got {lo}:{hi}")
    if not 0.0 <= options.cancel_fraction <= 1.0:
        raise ValueError(f"scenario {name}: cancel_fraction must be within [0, 1]")
    return options


def log_uniform(rng: random.Random, bounds: Range) -> int:
    lo, hi = bounds
    if lo >= hi:
        return lo
    return min(hi, max(lo, int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))))


def arrival_offsets(rng: random.Random, n: int, rate: float, options: ScenarioOptions) -> list[float]:
    """``n`` arrival offsets averaging ``rate`` requests/s, in bursts when the options say so."""
    offsets: list[float] = []
    t = 0.0
    while len(offsets) < n:
        size = min(n - len(offsets), rng.randint(*options.burst_size))
        # Bursts of mean size b arrive at rate/b so the long-run rate stays ``rate``.
        t += rng.expovariate(rate / ((options.burst_size[0] + options.burst_size[1]) / 2))
        spread = options.burst_spread_s if size > 1 else 0.0
        offsets += sorted(t + rng.uniform(0.0, spread) for _ in range(size))
    return offsets


def _requests(
    name: str, n: int, rate: float, options: ScenarioOptions, builder: TextBuilder, rng: random.Random
) -> list[TraceRequest]:
    prefixes = [builder.text(log_uniform(rng, options.prefix_tokens), rng) for _ in range(options.num_prefix_groups)]
    prefix_lens = [builder.count(p) for p in prefixes]
    requests = []
    for i, offset in enumerate(arrival_offsets(rng, n, rate, options)):
        num_prompt = log_uniform(rng, options.prompt_tokens)
        max_tokens = log_uniform(rng, options.output_tokens)
        messages: list[dict[str, str]] = []
        prefix_group: str | None = None
        total = num_prompt
        if prefixes:
            k = rng.randrange(len(prefixes))
            prefix_group = f"{name}-prefix-{k}"
            messages.append({"role": "system", "content": prefixes[k]})
            total += prefix_lens[k]
        if rng.random() < options.multi_turn_fraction:
            earlier, answer = max(1, num_prompt // 2), max(1, num_prompt // 4)
            num_prompt = max(1, num_prompt - earlier - answer)
            messages.append({"role": "user", "content": builder.text(earlier, rng)})
            messages.append({"role": "assistant", "content": builder.text(answer, rng)})
        user_text = builder.text(num_prompt, rng)
        messages.append({"role": "user", "content": user_text})
        cancel_after = None
        if max_tokens > 1 and rng.random() < options.cancel_fraction:
            cancel_after = rng.randint(1, max_tokens - 1)
        # A plain prompt: the shared prefix (if any) and the user text, no earlier turns.
        prompt = "".join(m["content"] for m in messages if m["role"] != "assistant") if options.completions else None
        requests.append(
            TraceRequest(
                id=f"{name}-{i}",
                max_tokens=max_tokens,
                messages=None if options.completions else messages,
                prompt=prompt,
                offset_s=offset,
                group=name,
                prefix_group=prefix_group,
                cancel_after=cancel_after,
                prompt_tokens=total,
            )
        )
    return requests


def generate(
    name: str,
    num_requests: int,
    seed: int,
    builder: TextBuilder,
    overrides: dict[str, object] | None = None,
) -> Trace:
    """The trace of ``num_requests`` requests of scenario ``name`` at 1 request/s nominal."""
    if num_requests < 1:
        raise ValueError("num_requests must be at least 1")
    rng = random.Random(f"ferry-loadtests:{name}:{seed}")
    if name == "mixed":
        requests: list[TraceRequest] = []
        counts = _mixed_counts(num_requests)
        for group, count in counts.items():
            if count:
                opts = scenario_options(group, overrides)
                requests += _requests(group, count, MIXED_SHARES[group], opts, builder, rng)
        requests.sort(key=lambda r: (r.offset_s, r.id))
        described: dict[str, object] = {g: dataclasses.asdict(scenario_options(g, overrides)) for g in counts}
    else:
        opts = scenario_options(name, overrides)
        requests = _requests(name, num_requests, 1.0, opts, builder, rng)
        described = dataclasses.asdict(opts)
    meta = {
        "scenario": name,
        "seed": seed,
        "tokenizer": builder.tokenizer.name,
        "nominal_rate": 1.0,
        "options": described,
    }
    return Trace(requests, meta)


def _mixed_counts(n: int) -> dict[str, int]:
    counts = {g: int(n * share) for g, share in MIXED_SHARES.items()}
    counts["chat"] += n - sum(counts.values())
    return counts
