"""How fast one decode-shaped matmul runs under this process's OpenMP settings.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.serving.omp_wait --threads 2
    GOMP_SPINCOUNT=1000 python -m benchmarks.serving.omp_wait --threads 2

GNU OpenMP reads its environment when torch loads, so each setting is its own
process. Prints the GFLOP/s of ``[m, k] @ [k, n]`` over a few one-second trials;
docs/benchmarks.md ("Threads: ferry's pool and OpenMP waits") compares the settings on a
shared machine.
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.omp_wait", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shape", default="64,576,1536", help="m,k,n (default: a decode step's MLP up projection)")
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    m, k, n = (int(v) for v in args.shape.split(","))
    x, w = torch.randn(m, k), torch.randn(n, k).t()
    for _ in range(3):
        torch.matmul(x, w)
    rates = []
    for _ in range(args.trials):
        start, reps = time.perf_counter(), 0
        while time.perf_counter() - start < 1.0:
            torch.matmul(x, w)
            reps += 1
        rates.append(2 * m * k * n * reps / (time.perf_counter() - start) / 1e9)
    policy = {key: os.environ[key] for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if key in os.environ}
    print(f"threads {args.threads} {policy or 'default'}: GFLOP/s " + ", ".join(f"{r:.1f}" for r in rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
