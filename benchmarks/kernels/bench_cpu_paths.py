"""Micro-benchmarks behind the CPU forward's choices (docs/benchmarks.md, "Kernels: decode attention").

Each part prints one line per case and the JSON of all of them goes to ``--out``;
times are the best of several repeats of wall time (the quiet-machine figure; on a
busy machine use ``bench_parts``' process CPU times instead).

- ``linear``: the model's products at M = 1, 16, 64, 2048 in bfloat16: ``F.linear``,
  oneDNN-packed (``packed_linear.PackedLinear``), and q/k/v + gate/up fused and packed.
- ``sdpa``: a 2,000-token prefill step (10 x 200-token causal prompts, 9/3 heads of 64):
  SDPA on the token-major (strided) views the runner had, on contiguous copies, and
  ``cpu_paged``'s prefill kernel (``csrc/prefill_attention.cpp``) on the strided views.
- ``decode``: the ``cpu_paged`` decode kernel at the common load's decode shape (64
  requests, contexts 201-264), 30 layers' caches read from memory, on a fresh server's
  block layout, a scattered one and a cache-resident one, bfloat16 and float32, beside the
  machine's streaming read rate.
- ``flex``: PyTorch's FlexAttention (compiled) as a paged decode with a block mask, one layer,
  against ``cpu_paged``.
- ``fused``: transformers' bfloat16 RMSNorm, rotary embedding and ``silu(gate) * up``
  against ferry's fused kernels (``services/worker/model/fused_ops.py``) at M = 64 and 2048.
- ``lmhead``: the tied LM head (49,152 x 576) at M = 1, 8, 64: ``F.linear`` and packed.
- ``int8``: ``--quantization int8``'s W8A8 layer (quantize, ``torch._int_mm``, dequantize) and
  weight-only int8 (``torch._weight_int8pack_mm``) against packed bfloat16.
- ``rate``: the offline engine fed the common load's 64 prompts at 2 requests/s in real
  time (what ``ferry serve`` sees at 2/s, without HTTP): TTFT and end-to-end
  percentiles, and the mean time of steps that carry a prefill and of decode-only steps.
  libgomp reads ``GOMP_SPINCOUNT`` / ``OMP_WAIT_POLICY`` at start, so compare those by
  running this once per setting.

    python -m benchmarks.kernels.bench_cpu_paths --parts linear,sdpa,decode,fused,lmhead,int8,rate --out results/cpu-paths.json
"""

# ruff: noqa: B023 - every closure is timed and dropped within its own loop iteration
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

H, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64  # SmolLM2-135M
BF16 = torch.bfloat16


def best_ms(fn: Callable[[], Any], n: int, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e3


def part_linear() -> list[dict[str, Any]]:
    lp, pack = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight
    shapes = {"q": 576, "k": 192, "v": 192, "gate": INTER, "up": INTER}
    w = {k: torch.randn(o, H).to(BF16) for k, o in shapes.items()}
    packed = {k: pack(t, 64) for k, t in w.items()}
    qkv = pack(torch.cat([w["q"], w["k"], w["v"]]), 64)
    gate_up = pack(torch.cat([w["gate"], w["up"]]), 64)
    rows = []
    for m in (1, 16, 64, 2048):
        x = torch.randn(m, H).to(BF16)
        n = 5 if m == 2048 else 100
        plain = best_ms(lambda: [F.linear(x, t) for t in w.values()], n)
        sep = best_ms(lambda: [lp(x, t, None, "none", [], "") for t in packed.values()], n)
        fused = best_ms(lambda: (lp(x, qkv, None, "none", [], ""), lp(x, gate_up, None, "none", [], "")), n)
        rows.append({"part": "linear", "m": m, "f_linear_ms": plain, "packed_ms": sep, "packed_fused_ms": fused})
        print(f"linear M={m:5d}: q,k,v,gate,up F.linear {plain:.3f} ms, packed {sep:.3f} ms, "
              f"fused+packed {fused:.3f} ms ({plain / fused:.2f}x)", flush=True)
    return rows


def part_sdpa() -> list[dict[str, Any]]:
    from services.kernels.build import load_extension

    kernel = load_extension()
    rows = []
    s, b = 200, 10
    spans = torch.tensor([[i * s, (i + 1) * s] for i in range(b)], dtype=torch.int64)
    for dt in (BF16, torch.float32):
        q = torch.randn(b * s, HEADS, HEAD_DIM).to(dt)
        k = torch.randn(b * s, KV_HEADS, HEAD_DIM).to(dt)
        v = torch.randn(b * s, KV_HEADS, HEAD_DIM).to(dt)
        out = torch.empty_like(q)

        def run(contiguous: bool) -> None:
            for i in range(b):
                sl = slice(i * s, (i + 1) * s)
                qp, kp, vp = (t[sl].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                if contiguous:
                    qp, kp, vp = qp.contiguous(), kp.contiguous(), vp.contiguous()
                F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)

        strided, contig = best_ms(lambda: run(False), 10), best_ms(lambda: run(True), 10)
        ours = best_ms(lambda: kernel.prefill_attention(q, k, v, out, spans, HEAD_DIM**-0.5, True), 10)
        fma = best_ms(lambda: kernel.prefill_attention(q, k, v, out, spans, HEAD_DIM**-0.5, False), 10)
        rows.append({"part": "sdpa", "dtype": str(dt), "strided_ms": strided, "contiguous_ms": contig,
                     "prefill_kernel_ms": ours, "prefill_kernel_fp32_fma_ms": fma})
        print(f"sdpa {dt}: 10 x 200-token causal prefills, SDPA strided {strided:.3f} ms, contiguous {contig:.3f} ms; "
              f"cpu_paged prefill kernel {ours:.3f} ms ({strided / ours:.2f}x; float32 FMAs {fma:.3f} ms)", flush=True)
    return rows


def fresh_table(n: int) -> torch.Tensor:
    """Block tables of ``n`` requests of up to 17 blocks as a fresh server lays them out: each
    prompt's 13 blocks consecutive, the 4 decode blocks interleaved across the requests."""
    table = torch.empty(n, 17, dtype=torch.int32)
    for i in range(n):
        table[i, :13] = torch.arange(13 * i, 13 * i + 13)
        table[i, 13:] = torch.tensor([13 * n + n * r + i for r in range(4)])
    return table


def part_decode() -> list[dict[str, Any]]:
    """The decode kernel at the common load's decode shape (64 requests, contexts 201-264, block
    size 16), one call per layer over 30 layers' own caches (2,912 blocks each, as a 1 GiB bf16
    cache holds), so the KV is read from memory as in a real step, on three block layouts:
    ``fresh`` (each request's prompt blocks consecutive, its decode blocks interleaved with the
    other requests', as a fresh server allocates them), ``scattered`` (a random permutation, as
    a long-running server's free list ends up) and ``resident`` (every request on the same 17
    blocks of one layer: cache-resident, the kernel's compute alone). A plain sum over as many
    bytes gives the machine's streaming read rate beside it."""
    from services.kernels.build import load_extension

    kernel = load_extension()
    rng = random.Random(0)
    n, blocks, bs, layers = 64, 2912, 16, 30
    lens = torch.tensor([rng.randint(201, 264) for _ in range(n)], dtype=torch.int32)
    tables = {"fresh": fresh_table(n), "scattered": torch.randperm(blocks)[: n * 17].view(n, 17).to(torch.int32).contiguous(),
              "resident": torch.arange(17, dtype=torch.int32).repeat(n, 1).contiguous()}
    rows = []
    for dt in (BF16, torch.float8_e4m3fn, torch.float32):  # float8: --kv-cache-dtype fp8, bfloat16 queries
        caches = [(torch.randn(blocks, bs, KV_HEADS, HEAD_DIM).to(dt), torch.randn(blocks, bs, KV_HEADS, HEAD_DIM).to(dt))
                  for _ in range(layers)]
        q = torch.randn(n, HEADS, HEAD_DIM).to(BF16 if dt == torch.float8_e4m3fn else dt)
        kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2 * caches[0][0].element_size() * layers
        for layout, table in tables.items():
            def step() -> None:
                for li in range(layers):
                    kc, vc = caches[0 if layout == "resident" else li]
                    kernel.paged_decode(q, kc, vc, table, lens, HEAD_DIM**-0.5, True)

            ms = best_ms(step, 3)
            rows.append({"part": "decode", "dtype": str(dt), "layout": layout, "ms_per_step": ms,
                         "gb_s": kv_bytes / ms / 1e6})
            print(f"decode {dt} {layout}: 64 requests, contexts 201-264, 30 layers: {ms:.2f} ms per step "
                  f"({kv_bytes / ms / 1e6:.1f} GB/s of KV)", flush=True)
        caches.clear()
        flat = torch.randn(kv_bytes // torch.empty(0, dtype=dt).element_size()).to(torch.uint8 if dt.itemsize == 1 else dt)
        ms = best_ms(lambda: flat.sum(), 3)
        rows.append({"part": "decode", "dtype": str(dt), "layout": "stream-read", "ms_per_step": ms,
                     "gb_s": kv_bytes / ms / 1e6})
        print(f"read {dt}: a plain sum over the same {kv_bytes / 1e6:.0f} MB: {ms:.2f} ms "
              f"({kv_bytes / ms / 1e6:.1f} GB/s)", flush=True)
    return rows


def part_flex() -> list[dict[str, Any]]:
    """PyTorch's FlexAttention (inductor-compiled) as a paged decode, the way vLLM's FlexAttention
    backend frames it: the whole cache as one long key sequence, a block mask whose mask_mod maps
    each physical slot to its request and position; one layer, the common load's decode shape
    (fresh layout), query blocks of 1 and 16 rows; against ``cpu_paged``'s kernel on the same data."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from services.kernels.build import load_extension

    kernel = load_extension()
    rng = random.Random(0)
    n, blocks, bs = 64, 2912, 16
    lens = torch.tensor([rng.randint(201, 264) for _ in range(n)], dtype=torch.int32)
    table = fresh_table(n)
    owner = torch.full((blocks,), -1, dtype=torch.int32)
    logical = torch.zeros(blocks, dtype=torch.int32)
    for i in range(n):
        used = table[i, : -(-int(lens[i]) // bs)].long()
        owner[used] = i
        logical[used] = torch.arange(len(used), dtype=torch.int32)
    kc = torch.randn(blocks, bs, KV_HEADS, HEAD_DIM).to(BF16)
    vc = torch.randn(blocks, bs, KV_HEADS, HEAD_DIM).to(BF16)
    q = torch.randn(n, HEADS, HEAD_DIM).to(BF16)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        blk = kv_idx // bs
        return (owner[blk] == q_idx) & (logical[blk] * bs + kv_idx % bs < lens[q_idx])

    qq = q.transpose(0, 1).unsqueeze(0)
    kk = kc.view(-1, KV_HEADS, HEAD_DIM).permute(1, 0, 2).unsqueeze(0)
    vv = vc.view(-1, KV_HEADS, HEAD_DIM).permute(1, 0, 2).unsqueeze(0)
    compiled = torch.compile(flex_attention, dynamic=False)
    ref = kernel.paged_decode(q, kc, vc, table, lens, HEAD_DIM**-0.5, True)
    paged_ms = best_ms(lambda: kernel.paged_decode(q, kc, vc, table, lens, HEAD_DIM**-0.5, True), 10)
    rows = []
    for qb in (1, 16):
        t = time.perf_counter()
        mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=blocks * bs, BLOCK_SIZE=(qb, bs),
                                 device="cpu")
        mask_s = time.perf_counter() - t
        t = time.perf_counter()
        out = compiled(qq, kk, vv, block_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True)
        compile_s = time.perf_counter() - t
        diff = (out[0].transpose(0, 1).float() - ref.float()).abs().max().item()
        ms = best_ms(lambda: compiled(qq, kk, vv, block_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True), 5, 3)
        rows.append({"part": "flex", "q_block": qb, "ms_per_layer": ms, "cpu_paged_ms": paged_ms,
                     "block_mask_s": mask_s, "first_call_s": compile_s, "max_abs_diff": diff})
        print(f"flex q_block {qb}: {ms:.2f} ms per layer against cpu_paged {paged_ms:.3f} ms; block mask "
              f"{mask_s:.1f} s, first call (compile) {compile_s:.1f} s; max |diff| {diff:.4f}", flush=True)
    return rows


def part_fused() -> list[dict[str, Any]]:
    from transformers.models.llama import modeling_llama

    from services.kernels.build import load_extension

    kernel = load_extension()
    rope = getattr(modeling_llama.apply_rotary_pos_emb, "ferry_original", modeling_llama.apply_rotary_pos_emb)
    norm = modeling_llama.LlamaRMSNorm(H, eps=1e-5).to(BF16)
    rows = []
    for m in (64, 2048):
        n = 20 if m == 2048 else 200
        x = torch.randn(m, H).to(BF16)
        gu = torch.randn(m, 2 * INTER).to(BF16)
        qkv = torch.randn(m, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(BF16)
        q = qkv[:, : HEADS * HEAD_DIM].view(1, m, HEADS, HEAD_DIM).transpose(1, 2)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(1, m, KV_HEADS, HEAD_DIM).transpose(1, 2)
        angles = torch.rand(1, m, HEAD_DIM) * 100
        cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
        with torch.inference_mode():
            cases = {
                "rms_norm": (lambda: norm(x), lambda: kernel.rms_norm(x, norm.weight, 1e-5)),
                "silu_and_mul": (lambda: F.silu(gu[:, :INTER]) * gu[:, INTER:], lambda: kernel.silu_and_mul(gu)),
                "rotary": (lambda: rope(q, k, cos, sin),
                           lambda: kernel.rotary(q[0].transpose(0, 1), k[0].transpose(0, 1), cos[0], sin[0])),
            }
            for name, (hf, fused) in cases.items():
                a, b = best_ms(hf, n), best_ms(fused, n)
                rows.append({"part": "fused", "op": name, "m": m, "transformers_ms": a, "fused_ms": b})
                print(f"fused {name} M={m}: transformers {a:.3f} ms, fused {b:.3f} ms ({a / b:.2f}x)", flush=True)
    return rows


def part_lmhead() -> list[dict[str, Any]]:
    lp, pack = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight
    w = torch.randn(49152, H).to(BF16)
    pw = pack(w, 64)
    rows = []
    for m in (1, 8, 64):
        x = torch.randn(m, H).to(BF16)
        plain, packed = best_ms(lambda: F.linear(x, w), 20), best_ms(lambda: lp(x, pw, None, "none", [], ""), 20)
        rows.append({"part": "lmhead", "m": m, "f_linear_ms": plain, "packed_ms": packed})
        print(f"lmhead M={m}: F.linear {plain:.2f} ms, packed {packed:.2f} ms ({plain / packed:.2f}x)", flush=True)
    return rows


def part_int8() -> list[dict[str, Any]]:
    from torch import nn

    from services.worker.model.quantize import Int8Linear, int8_kernels

    lp, pack = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight
    kernels = int8_kernels()
    rows = []
    for out, inp in ((960, H), (2 * INTER, H), (H, INTER)):
        linear = nn.Linear(inp, out, bias=False).to(BF16)
        w = linear.weight.detach()
        scale = w.float().abs().amax(1) / 127
        wq = (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        pw, sc = pack(w, 64), scale.to(BF16)
        w8a8 = Int8Linear(linear, kernels, torch.ones(inp))  # oneDNN's prepacked products where onednn_int8()
        w8a8_mm = Int8Linear(linear, kernels, torch.ones(inp), onednn=False)  # torch._int_mm's
        for m in (1, 64, 512, 2048):
            x = torch.randn(m, inp).to(BF16)
            n = 3 if m == 2048 else 10 if m == 512 else 50
            bf = best_ms(lambda: lp(x, pw, None, "none", [], ""), n)
            i8 = best_ms(lambda: torch._weight_int8pack_mm(x, wq, sc), n)
            a8 = best_ms(lambda: w8a8(x), n)
            a8mm = best_ms(lambda: w8a8_mm(x), n)
            rows.append({"part": "int8", "shape": [out, inp], "m": m, "bf16_packed_ms": bf, "int8_weight_only_ms": i8,
                         "w8a8_ms": a8, "w8a8_int_mm_ms": a8mm, "w8a8_onednn": w8a8._onednn})
            print(f"int8 [{out}x{inp}] M={m}: bf16 packed {bf:.3f} ms, int8 weight-only {i8:.3f} ms, "
                  f"W8A8 (--quantization int8{', oneDNN prepacked' if w8a8._onednn else ''}) {a8:.3f} ms "
                  f"({bf / a8:.2f}x packed bf16), W8A8 on torch._int_mm {a8mm:.3f} ms", flush=True)
    return rows


def part_rate(rate: float = 2.0, num: int = 64) -> list[dict[str, Any]]:
    from services.engine.offline import GATEWAY_ID, LLM, GenerationParams
    from shared.messages import AddRequest

    llm = LLM(dtype="bfloat16", num_threads=2, kv_cache_memory=1 << 30)
    rng = random.Random(0)
    params = GenerationParams(max_tokens=64, temperature=0, ignore_eos=True)
    eos = llm.runner.eos_token_ids
    llm.generate([[rng.randrange(100, 40000) for _ in range(200)]], GenerationParams(max_tokens=4, ignore_eos=True),
                 decode=False)
    reqs = [AddRequest(req_id=f"r{i}", gateway_id=GATEWAY_ID, sampling=params.sampling(), stop=params.stop_params(eos),
                       prompt_token_ids=[rng.randrange(100, 40000) for _ in range(200)], arrival_time=time.time())
            for i in range(num)]
    sched, t0, i = llm.scheduler, time.perf_counter(), 0
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    steps: list[tuple[int, int, float]] = []
    while i < num or sched.has_unfinished_requests():
        while i < num and time.perf_counter() - t0 >= i / rate:
            sched.add_request(reqs[i])
            arrived[reqs[i].req_id] = time.perf_counter() - t0
            i += 1
        plan = sched.schedule()
        if not plan.total_num_scheduled_tokens:
            time.sleep(0.002)
            continue
        ts = time.perf_counter()
        result = llm.runner.execute(plan)
        steps.append((plan.total_num_scheduled_tokens, len(plan.num_scheduled_tokens), time.perf_counter() - ts))
        sched.update_from_result(plan, result)
        now = time.perf_counter() - t0
        for deltas in sched.take_deltas().values():
            for d in deltas:
                if d.new_token_ids:
                    first.setdefault(d.req_id, now)
                if d.finish_reason:
                    done[d.req_id] = now
    ttft = sorted(first[r] - arrived[r] for r in arrived)
    e2e = sorted(done[r] - arrived[r] for r in arrived)
    pre = [s for s in steps if s[0] > s[1]]
    dec = [s for s in steps if s[0] == s[1]]
    row = {"part": "rate", "rate": rate, "ttft_p50_s": ttft[len(ttft) // 2], "ttft_p95_s": ttft[int(0.95 * len(ttft))],
           "e2e_p50_s": e2e[len(e2e) // 2], "e2e_p95_s": e2e[int(0.95 * len(e2e))], "steps": len(steps),
           "prefill_step_ms": statistics.mean(s[2] for s in pre) * 1e3,
           "decode_step_ms": statistics.mean(s[2] for s in dec) * 1e3,
           "decode_batch": statistics.mean(s[1] for s in dec)}
    print(f"rate {rate}/s offline: TTFT p50 {row['ttft_p50_s']:.3f} s p95 {row['ttft_p95_s']:.3f} s; e2e p50 "
          f"{row['e2e_p50_s']:.2f} s p95 {row['e2e_p95_s']:.2f} s; {len(pre)} prefill steps of "
          f"{row['prefill_step_ms']:.0f} ms, {len(dec)} decode steps of {row['decode_step_ms']:.0f} ms "
          f"(batch {row['decode_batch']:.1f})", flush=True)
    return [row]


PARTS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "linear": part_linear, "sdpa": part_sdpa, "decode": part_decode, "flex": part_flex, "fused": part_fused,
    "lmhead": part_lmhead, "int8": part_int8, "rate": part_rate,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench_cpu_paths", description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="linear,sdpa,decode,int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    for name in args.parts.split(","):
        rows += PARTS[name.strip()]()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
