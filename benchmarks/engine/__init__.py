"""The offline engine measured as a whole: throughput against transformers, dtype, int8
quality, where a step's time goes, sampling, structured outputs.

Their OpenMP threads wait as a served worker's do (GOMP_SPINCOUNT=10000 unless the operator
chose a policy; services/worker/service.py): libgomp reads it when torch loads, and every
module here passes through this package first (several import torch before the engine).
"""

import os as _os

from services.worker.service import default_openmp_wait_policy as _default_openmp_wait_policy

_default_openmp_wait_policy(_os.environ)
