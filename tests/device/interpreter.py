"""Run Triton kernels on CPU tensors: ``TRITON_INTERPRET=1`` plus one compatibility fix.

Call ``enable_interpreter()`` before anything imports the kernels: ``triton.jit``
decides at decoration time whether a function is compiled or interpreted.

The fix: Triton 3.6's interpreter turns a scalar tensor into a Python int with
``int(handle.data)``, but its scalars are 1-element arrays and numpy >= 2.4
refuses ``int()`` of a 1-d array, so ``range(start, end)`` with loaded bounds
(every paged-attention loop) fails. We convert through ``.item()`` instead.
Compiled kernels on a GPU never take this path.
"""

from __future__ import annotations

import os
import sys


def enable_interpreter() -> bool:
    """True when Triton imports and its kernels will run interpreted on the CPU."""
    os.environ["TRITON_INTERPRET"] = "1"
    loaded = [m for m in ("services.worker.backends.triton_kernels", "services.worker.backends.triton_backend")
              if m in sys.modules]
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    if not getattr(interpreter, "_ferry_index_fix", False):
        original = interpreter._patch_lang_tensor

        def _patch(tensor, scope):  # type: ignore[no-untyped-def]
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

        interpreter._patch_lang_tensor = _patch
        interpreter._ferry_index_fix = True
    if loaded:  # imported before the switch: compiled-mode functions, reload them interpreted
        import importlib

        for name in loaded:
            importlib.reload(sys.modules[name])
    return True
