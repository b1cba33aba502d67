"""Test-only fault injection, loaded by Python at start-up when this folder is on PYTHONPATH.

With ``FERRYTEST_POISON_TOKEN_ID=<id>`` in the environment (set only by
tests/integration/test_faults_poison.py), every worker process's
``ModelRunner.execute`` raises when a step computes a new or resumed request whose
prompt holds that token id: a request that crashes the worker at every attempt, as
an input that breaks the forward would. Nothing in ferry reads this variable; the
serving code is unchanged, the hook wraps it from outside.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

TARGET = "services.worker.runner"
_POISON = os.environ.get("FERRYTEST_POISON_TOKEN_ID")


def _patch(module: ModuleType, poison: int) -> None:
    runner_cls = module.ModelRunner
    original = runner_cls.execute

    def execute(self: Any, plan: Any) -> Any:
        for req in list(plan.new_requests) + list(plan.resumed_requests):
            if poison in req.prompt_token_ids:
                raise RuntimeError(f"injected fault: token {poison} scheduled (request {req.req_id})")
        return original(self, plan)

    runner_cls.execute = execute


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, poison: int) -> None:
        self.poison = poison

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        poison = self.poison

        def patched(module: ModuleType) -> None:
            exec_module(module)
            _patch(module, poison)

        loader.exec_module = patched  # type: ignore[method-assign]
        return spec


if _POISON:
    sys.meta_path.insert(0, _Hook(int(_POISON)))
