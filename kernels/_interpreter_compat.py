"""Keeps Triton 3.6's CPU interpreter (TRITON_INTERPRET=1, used by the CPU test run) working on numpy >= 2.4.

The interpreter turns a scalar kernel argument used as a loop bound into `int(array_of_shape_(1,))`,
which numpy 2.4 made an error ("only 0-dimensional arrays can be converted to Python scalars"). We
re-register `tensor.__index__` to read the single element. Compiled (GPU) kernels never come here.
"""

from __future__ import annotations

import os

import numpy as np


def _install() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_atlas_patched", False):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patch_lang_tensor._atlas_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


_install()
