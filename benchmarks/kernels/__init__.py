"""Micro-benchmarks of the CPU kernels and the worker's parts (attention, linear layers,
a decode step's layers, the sampler), each against its alternative in one process.

Their OpenMP threads wait as a served worker's do (GOMP_SPINCOUNT=10000 unless the operator
chose a policy; services/worker/service.py): libgomp reads it when torch loads, and every
module here passes through this package first.
"""

import os as _os

from services.worker.service import default_openmp_wait_policy as _default_openmp_wait_policy

_default_openmp_wait_policy(_os.environ)
