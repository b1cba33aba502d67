"""What structured outputs cost: decode step time with 0, 1 and all requests of a batch under a grammar,
and the compile time of a grammar per schema (first time, and from the cache).

    python -m benchmarks.engine.grammar_bench --model smollm2-135m-instruct --batch 16 --out grammar.json

The batch decodes greedily (``ignore_eos``) in lock-step through the real scheduler and
model runner; only steps in which every request decodes are timed. Constrained requests
follow an unbounded JSON schema (an array of strings: the mask changes every token and
never forces an end). ``step_s`` is the whole ``ModelRunner.execute``; ``sample_s`` the
sampling part of it, where the masks are computed and applied.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

from shared.grammar import GrammarCache, json_schema_grammar, load_tokenizer
from shared.messages import AddRequest, SamplingParams, StopParams
from shared.models import DEFAULT_MODEL, resolve_model, tokenizer_dir

DECODE_SCHEMA = {"type": "array", "items": {"type": "string"}}


def _schemas() -> dict[str, dict[str, Any]]:
    wide = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "null"]}
                                             for i in range(60)}, "required": [f"field_{i}" for i in range(0, 60, 2)]}
    nested: dict[str, Any] = {"type": "string"}
    for depth in range(8):
        nested = {"type": "object", "properties": {f"l{depth}": nested, "items": {"type": "array", "items": nested}},
                  "required": [f"l{depth}"]}
    return {
        "small (1 property)": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        "person (4 properties, enum, array)": {
            "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                             "role": {"enum": ["admin", "user", "guest"]},
                                             "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["name", "age", "role"]},
        "wide (60 properties)": wide,
        "nested (8 levels)": nested,
        "pattern strings": {"type": "object", "properties": {
            "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
            "email": {"type": "string", "format": "email"}, "uuid": {"type": "string", "format": "uuid"}}},
    }


def compile_times(cache_tok: Any, repeats: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, schema in _schemas().items():
        firsts, hits = [], []
        for _ in range(repeats):
            cache = GrammarCache(cache_tok)
            grammar = json_schema_grammar(schema)
            t0 = time.perf_counter()
            cache.matcher(grammar)
            t1 = time.perf_counter()
            cache.matcher(grammar)
            t2 = time.perf_counter()
            firsts.append(t1 - t0)
            hits.append(t2 - t1)
        out[name] = {"compile_ms": 1000 * statistics.median(firsts), "cached_ms": 1000 * statistics.median(hits)}
    return out


def _decode_round(llm: Any, batch: int, num_constrained: int, steps: int, grammar: str,
                  tag: str) -> tuple[list[float], list[float], list[float]]:
    prompt = llm.tokenizer.encode("Write a list of fruit names as JSON:")
    for i in range(batch):
        llm.scheduler.add_request(AddRequest(
            req_id=f"{tag}-{i}", gateway_id="bench", prompt_token_ids=prompt,
            sampling=SamplingParams(temperature=0.0, grammar=grammar if i < num_constrained else ""),
            stop=StopParams(max_tokens=steps + 2, ignore_eos=True), arrival_time=time.time()))
    step_s: list[float] = []
    sample_s: list[float] = []
    cpu_s: list[float] = []
    while llm.scheduler.has_unfinished_requests():
        plan = llm.scheduler.schedule()
        t0, c0 = time.perf_counter(), time.process_time()
        result = llm.runner.execute(plan)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        llm.scheduler.update_from_result(plan, result)
        llm.scheduler.take_deltas()
        if plan.total_num_scheduled_tokens == batch and len(result.req_ids) == batch and not plan.new_requests:
            step_s.append(elapsed)
            sample_s.append(result.sample_s)
            cpu_s.append(cpu)
    return step_s[1:], sample_s[1:], cpu_s[1:]  # the first decode warms caches


def step_times(model: str, dtype: str, batch: int, steps: int, threads: int, rounds: int) -> dict[str, dict[str, float]]:
    """The three cases interleaved, round after round, so that they share the machine's conditions."""
    from services.engine.offline import LLM

    llm = LLM(model=model, dtype=dtype, kv_cache_memory=256 << 20, num_threads=threads,
              max_num_seqs=batch, max_num_batched_tokens=max(512, batch * 32))
    grammar = json_schema_grammar(DECODE_SCHEMA)
    cases = {f"{k}_of_{batch}_constrained": k for k in (0, 1, batch)}
    steps_s: dict[str, list[float]] = {name: [] for name in cases}
    samples_s: dict[str, list[float]] = {name: [] for name in cases}
    cpus_s: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name, k in cases.items():
            a, b, c = _decode_round(llm, batch, k, steps, grammar, f"{name}-{r}")
            steps_s[name] += a
            samples_s[name] += b
            cpus_s[name] += c
    llm.runner.constraints.close()
    base_step = statistics.median(steps_s[f"0_of_{batch}_constrained"])
    base_sample = statistics.median(samples_s[f"0_of_{batch}_constrained"])
    base_cpu = statistics.median(cpus_s[f"0_of_{batch}_constrained"])
    out: dict[str, dict[str, float]] = {}
    for name in cases:
        step, sample = statistics.median(steps_s[name]), statistics.median(samples_s[name])
        cpu = statistics.median(cpus_s[name])
        out[name] = {"num_steps": len(steps_s[name]), "step_ms_median": 1000 * step,
                     # CPU time of the process per step: far steadier than wall time on a shared machine
                     "step_cpu_ms_median": 1000 * cpu, "step_cpu_vs_unconstrained": cpu / base_cpu - 1.0,
                     "sample_ms_median": 1000 * sample,
                     # what the constraints add to a step (all of it is in the sampling phase), as a share
                     # of the unconstrained step: what every request of the batch pays
                     "added_sample_vs_step": (sample - base_sample) / base_step,
                     "step_vs_unconstrained": step / base_step - 1.0}
    return out


def constraint_cpu(tok: Any, batch: int, steps: int) -> dict[str, dict[str, float]]:
    """CPU time (this thread, torch at 1 thread) of the constraint work alone per decode step:
    masks (``for_step``), ``apply_constraints`` on [batch, vocab] logits, and ``advance``."""
    import torch

    from services.worker.batch import BatchState
    from services.worker.logits_processors import ConstraintTracker, apply_constraints
    from shared.messages import NewRequestData, StepPlan

    torch.set_num_threads(1)
    grammar = json_schema_grammar(DECODE_SCHEMA)
    out: dict[str, dict[str, float]] = {}
    for k in (0, 1, batch):
        tracker = ConstraintTracker(lambda: tok)
        state = BatchState(16)
        plan = StepPlan(step_id=0, new_requests=[NewRequestData(
            req_id=f"r{i}", prompt_token_ids=[1, 2], block_ids=list(range(64)), num_computed_tokens=0,
            sampling=SamplingParams(temperature=0.0, grammar=grammar if i < k else "")) for i in range(batch)])
        state.apply(plan)
        tracker.sync(plan)
        states = list(state.requests.values())
        times: list[float] = []
        for _ in range(steps):
            logits = torch.randn(batch, tok.vocab_size)
            t0 = time.thread_time()
            apply_constraints(logits, tracker.for_step(states))
            tokens = logits.argmax(dim=-1).tolist()
            tracker.advance(states, tokens)
            times.append(time.thread_time() - t0)
            for s, t in zip(states, tokens, strict=True):
                s.append_token(t)
        tracker.close()
        out[f"{k}_of_{batch}_constrained"] = {"cpu_ms_median": 1000 * statistics.median(times[2:])}
    return out


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="compiles per schema")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three cases")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    folder = tokenizer_dir(resolve_model(args.model))
    with open(folder / "config.json") as f:
        vocab_size = int(json.load(f)["vocab_size"])
    tok = load_tokenizer(folder, vocab_size, [])
    tokenizer_load_s = time.perf_counter() - t0
    report: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "batch": args.batch, "threads": args.threads,
        "cpu": _cpu(), "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "tokenizer_load_s": tokenizer_load_s, "compile": compile_times(tok, args.repeats),
    }
    report["constraint_cpu"] = constraint_cpu(tok, args.batch, 60)
    print("constraint CPU per step:", report["constraint_cpu"], flush=True)
    report["step"] = step_times(args.model, args.dtype, args.batch, args.steps, args.threads, args.rounds)
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
