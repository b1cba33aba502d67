"""The engine as a unit: one scheduler composed with its worker ranks.

The worker follows plans and never schedules, so nothing in ``services/worker``
imports the scheduler; whatever puts the two together lives here: the offline
engine (``offline.LLM``, scheduler and model runner in one process) and its
tensor-parallel helper ranks. Its benchmarks live in ``benchmarks/engine`` (not shipped).
"""

import os as _os

from services.worker.service import default_openmp_wait_policy as _default_openmp_wait_policy

# The offline engine's OpenMP threads wait as a served worker's do (GOMP_SPINCOUNT=10000 unless
# the operator chose a policy): libgomp reads it when torch loads, and every way into the
# engine (offline.LLM, its tensor-parallel ranks) passes through this package first. With
# libgomp's default spin the common load ran ~5 % slower offline on a 2-core Xeon in bfloat16
# and ~50 % slower with --quantization int8 (docs/benchmarks.md, "Threads: ferry's pool and
# OpenMP waits"); where torch was loaded before, it changes nothing.
_default_openmp_wait_policy(_os.environ)
