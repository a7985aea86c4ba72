"""Fixes to Triton's CPU interpreter (TRITON_INTERPRET=1, used by the CPU test run; 3.6 to 3.9: a CPU torch pins
no triton, so a fresh dev venv takes the newest).

- A scalar kernel argument used as a loop bound becomes `int(array_of_shape_(1,))`, which numpy 2.4 made
  an error ("only 0-dimensional arrays can be converted to Python scalars"): `tensor.__index__` is
  re-registered to read the single element.
- `tl.dot` on bf16 operands multiplies their raw uint16 storage as integers (garbage of order 1e10):
  bf16 operands are widened to fp32 first, which is what the tensor cores compute too.
- `x.to(tl.bfloat16)` of fp32 truncated the mantissa (round toward zero) where the GPU rounds to nearest
  even: a kernel rounding its intermediates as the torch path does (a hyper-site kernel, since deleted) came out 4x less
  accurate than on a GPU (1.5e-2 against 3.8e-3 relative). fp32 -> bf16 casts now round to nearest even.
- Triton 3.9's masked loads and stores (a C++ routine) take only boolean masks, where a mask combined from a
  tensor comparison and a scalar one arrives as integers ("mask has unsupported dtype"): masks are made boolean.

Compiled (GPU) kernels never come here.
"""

from __future__ import annotations

import os

import numpy as np


def _install() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_atlas_patched", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patch_lang_tensor._atlas_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor

    builder = interpreter.InterpreterBuilder
    original_dot = builder.create_dot

    def widen_bf16(handle):
        if handle.dtype != tl.bfloat16:
            return handle
        widened = (handle.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(widened, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen_bf16(a), widen_bf16(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot

    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder.cast_impl = cast_impl

    def boolean(mask):
        if mask is None or mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)

    original_load, original_store = builder.create_masked_load, builder.create_masked_store

    def create_masked_load(self, ptrs, mask, *rest):  # (the cache arguments differ between releases)
        return original_load(self, ptrs, boolean(mask), *rest)

    def create_masked_store(self, ptrs, value, mask, *rest):
        return original_store(self, ptrs, value, boolean(mask), *rest)

    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store


_install()
