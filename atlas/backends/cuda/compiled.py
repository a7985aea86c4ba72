"""torch.compile of the regions' elementwise-heavy blocks (Tuning.compile), one compiled graph per
block kind reused by every layer: the blocks take tensors and plain numbers (no weight dict, no layer-name
strings), so every layer's call hits the same guards and Dynamo compiles once per (block, shape), not once per
layer (24 layers would pass its recompile limit and fall back to eager).

Inductor fuses each block's elementwise chain (norm, split, silu, sigmoid, mix, mean) into a few Triton kernels
around the two GEMMs: a hyper-connection site is ~13 kernels eager. Compiled code runs inside the decode CUDA
graphs (the graphs' two warm-up runs compile before the capture); the mode leaves graph capture to us.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

# the mode compiled regions take (Tuning.compile): Inductor's default mode with its combo kernels, independent
# kernels of a graph fused into one launch (H200, against the plain default mode: decode b1 3.60 -> 3.23 ms, kernels
# 1,089 -> 885); options scoped to the compiled function (torch.compile(options=...): no global Inductor config is
# touched)
COMPILE_MODE = "combo"
INDUCTOR_OPTIONS: dict[str, tuple[tuple[str, bool], ...]] = {"combo": (("combo_kernels", True),)}


@functools.cache
def _compile(fn: Callable, mode: str) -> Callable:
    # dynamic=None (automatic): the first shape compiles static, a second shape of the same block recompiles once
    # with symbolic sizes, so batch buckets 1..64 cost two compiles a block, not one each (dynamic=False would
    # compile hyper_block x 2, moe_router once per bucket: on the CPU one compile of the three took 113 s wall).
    # Prefill chunks mark their token dimension dynamic before the first call (regions._token_dim): one compile.
    # fullgraph=True: every block traces whole (tests/test_cuda_regions.py), and without it a 32-token prefill chunk
    # of atlas-tiny raised ConstraintViolationError (the marked token dimension specialised to 32 once Dynamo
    # retried gdn_tail's inner hyper_inject as a frame of its own); with it the same chunks compile and give the
    # reference's tokens (CPU, eager and Inductor)
    dynamo = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):  # the name moved between torch versions
        if hasattr(dynamo, knob):
            setattr(dynamo, knob, max(getattr(dynamo, knob), 32))
    if mode in INDUCTOR_OPTIONS:  # torch.compile takes a mode or options, not both: these are "default" + options
        return torch.compile(fn, options=dict(INDUCTOR_OPTIONS[mode]), dynamic=None, fullgraph=True)
    return torch.compile(fn, mode=mode, dynamic=None, fullgraph=True)


def compiled(fn: F, mode: str) -> F:
    """fn itself for mode "none", else its torch.compile'd version (cached: one per (fn, mode))."""
    if mode == "none":
        return fn
    return _compile(fn, mode)  # type: ignore[return-value]
