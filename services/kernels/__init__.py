"""ferry's native CPU kernels: the C++ sources (``csrc/``), their one loader (``build``) and
the one Python facade every layer calls (``ops``).

The package imports nothing else of ferry (tests/unit/test_import_rules.py), so the worker's
layers and attention backends depend on it and never the other way round.
"""
