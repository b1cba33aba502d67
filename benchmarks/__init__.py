"""Studies and micro-benchmarks of ferry, run from a checkout and never shipped.

Nothing in ``services``, ``shared``, ``ferry_cli`` or ``loadtests`` imports this
package (tests/unit/test_import_rules.py): a study may import any of them, never
the other way round. ``ferry bench`` (``loadtests``) is the shipped load tool.

- ``kernels/``: the CPU kernels and the worker's parts, one op or layer at a time;
- ``engine/``: the offline engine as a whole (throughput, dtype, quality, profile,
  sampling, grammars);
- ``serving/``: the served stack's own costs (scheduler, gateway, serving against
  offline, OpenMP waits, data parallel, an engine killed under load, an
  authentication flood);
- ``peers/``: ``ferry serve`` beside vLLM's CPU build on one trace, and that trace's
  GEMM limit.

Each module runs with ``python -m benchmarks.<group>.<module>``; the ones with a make
target keep it (``make bench-offline``, ``make bench-peers``, ...). docs/benchmarks.md
holds the numbers and their commands.
"""
