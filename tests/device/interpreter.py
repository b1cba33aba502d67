"""Run Triton kernels on CPU tensors: ``TRITON_INTERPRET=1`` plus one compatibility fix.

Call ``enable_interpreter()`` before anything imports the kernels: ``triton.jit``
decides at decoration time whether a function is compiled or interpreted.

The fix: Triton 3.6's interpreter turns a scalar tensor into a Python int with
``int(handle.data)``, but its scalars are 1-element arrays and numpy >= 2.4
refuses ``int()`` of a 1-d array, so ``range(start, end)`` with loaded bounds
(every paged-attention loop) fails. We convert through ``.item()`` instead.
Second fix: the interpreter keeps bfloat16 values as raw 16-bit patterns and its
``tl.dot`` multiplies those integers; we widen bf16 operands to float32 first
(exact, as a bf16 MMA with fp32 accumulation is). Compiled kernels on a GPU never
take either path.
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
        _fix_bf16_dot(interpreter)
        interpreter._ferry_index_fix = True
    kernels = sys.modules.get("services.worker.backends.triton_kernels")
    if kernels is not None and isinstance(kernels._decode_kernel, interpreter.InterpretedFunction):
        loaded = []  # already interpreted: a reload would only fork the backend class
    if loaded:  # imported before the switch: compiled-mode functions, reload them interpreted
        import importlib

        for name in loaded:
            importlib.reload(sys.modules[name])
    return True


def _fix_bf16_dot(interpreter) -> None:  # type: ignore[no-untyped-def]
    import numpy as np
    import triton.language as tl

    builder_cls = interpreter.InterpreterBuilder
    original = builder_cls.create_dot

    def _widen(handle):  # type: ignore[no-untyped-def]
        if handle.dtype != tl.bfloat16:
            return handle
        bits = handle.data.view(np.uint16).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        return original(self, _widen(a), _widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot
