"""torch.compile of the decode step's elementwise-heavy blocks (Tuning.compile_decode), one compiled graph per
block kind reused by every layer: the blocks take tensors and plain numbers (no weight dict, no layer-name
strings), so every layer's call hits the same guards and Dynamo compiles once per (block, shape), not once per
layer (24 layers would pass its recompile limit and fall back to eager).

Inductor fuses each block's elementwise chain (norm, split, silu, sigmoid, mix, mean) into a few Triton kernels
around the two GEMMs: a hyper-connection site is ~13 kernels eager. Compiled code runs inside the decode CUDA
graphs (the graphs' two warm-up runs compile before the capture); "default" and
"max-autotune-no-cudagraphs" leave graph capture to us.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

# Tuning.compile_decode / compile_prefill modes that are Inductor's default mode with config options, scoped to
# the compiled function (torch.compile(options=...): no global Inductor config is touched).
# "tuned": coordinate-descent tuning of each generated kernel's launch (block sizes, warps) by timing it at
# compile time, for the batch-1 decode's ~500 small persistent reductions (~2.7 us each, H200 session 10);
# "combo": horizontal fusion of independent kernels of a graph into one launch (fewer launches a step);
# "tuned-combo": both.
INDUCTOR_OPTIONS: dict[str, tuple[tuple[str, bool], ...]] = {
    "tuned": (("coordinate_descent_tuning", True),),
    "combo": (("combo_kernels", True),),
    "tuned-combo": (("coordinate_descent_tuning", True), ("combo_kernels", True)),
    # combo, and inner reductions of up to PERSISTENT_INNER elements persistent (_persistent_choices); its graphs
    # are kept out of Inductor's FX graph cache, whose key does not see a choices handler
    "combo-persistent": (("combo_kernels", True), ("fx_graph_cache", False)),
    # combo, and every generated Triton kernel launched with programmatic dependent launch (sm_90+; PDL_OPTION)
    "combo-pdl": (("combo_kernels", True), ("triton.enable_pdl", True)),
}
# "combo-pdl": a batch-1 decode step is ~840 kernels for ~2.6 ms of device time (H200 session 15), ~700 of them
# Inductor's, mostly persistent reductions of ~2.7 us, near a kernel's latency floor: the step is the launches' and
# tails' gaps more than its bytes. With PDL (Hopper's griddepcontrol) a kernel is launched while the one before it
# is still running (the one before signals once its loads are issued); it waits (griddepcontrol.wait) only where it
# first reads what that one wrote, so its launch and prologue overlap the predecessor's tail. Inductor decides the
# wait and the signal per kernel (torch._inductor.codegen.triton, its "triton.enable_pdl" option, off by default);
# captured into our decode CUDA graphs the launches become programmatic edges. Only Inductor's own kernels take it:
# cuBLAS's and atlas_kernels' launches keep full stream order (a kernel after them starts when they end)
PDL_OPTION = "triton.enable_pdl"
# "combo-persistent": Inductor makes an inner reduction (one row's) persistent, the whole row in one program, only up
# to 1,024 elements (torch._inductor.choices.InductorChoices.should_use_persistent_reduction); above that it loops
# over the row, and a consumer of the row's result over the same elements becomes a second kernel. A hyper site's
# per-stream RMSNorm reduces H = 2,048 elements: in a 2,048-token prefill (H200 session 15 profile) a looped
# reduction (the injection and the sums of squares, ~19 us) then a pointwise pass re-reading the streams to write the
# normed ones (~16 us), 48 of each. Persistent up to 2,048, the two are one kernel
PERSISTENT_INNER = 2048


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
    if mode == "combo-persistent":
        return _with_choices(torch.compile(fn, options=dict(INDUCTOR_OPTIONS[mode]), dynamic=None, fullgraph=True),
                             _persistent_choices(PERSISTENT_INNER))
    if PDL_OPTION in dict(INDUCTOR_OPTIONS.get(mode, ())):
        _require_pdl(mode)
    if mode in INDUCTOR_OPTIONS:  # torch.compile takes a mode or options, not both: these are "default" + options
        return torch.compile(fn, options=dict(INDUCTOR_OPTIONS[mode]), dynamic=None, fullgraph=True)
    return torch.compile(fn, mode=mode, dynamic=None, fullgraph=True)


def _inductor_knows(option: str) -> bool:
    """Whether this torch's Inductor config has the (dotted) option."""
    from torch._inductor import config

    head, _, name = option.rpartition(".")
    return hasattr(getattr(config, head) if head else config, name)


def _require_pdl(mode: str) -> None:
    """A one-line error naming the mode and the torch version where Inductor has no PDL option (added in torch 2.10's
    cycle); torch.compile would otherwise fail at the first call with Inductor's own message."""
    if not _inductor_knows(PDL_OPTION):
        raise ValueError(f"compile mode {mode!r} needs Inductor's {PDL_OPTION} option, which torch "
                         f"{torch.__version__} does not have: use compile mode 'combo'")


def _persistent_choices(limit: int):  # type: ignore[no-untyped-def]
    """Inductor's heuristics with inner reductions of up to `limit` elements (statically known) persistent."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class WiderPersistence(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction):  # type: ignore[no-untyped-def]
            if (config.triton.persistent_reductions and not cooperative_reduction
                    and features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, limit)):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

    return WiderPersistence()


def _with_choices(fn: Callable, choices: object) -> Callable:
    """fn run with Inductor's choices handler set to `choices`: Inductor compiles at a compiled function's first call
    (and at a recompile), inside that call, so the handler is the one its codegen consults. Outside the call the
    process's own handler is back (other compiled functions keep Inductor's heuristics). Under the CUDA graphs a call
    happens at the capture only, not at a replay."""
    from torch._inductor.virtualized import V

    @functools.wraps(fn)
    def call(*args, **kwargs):  # type: ignore[no-untyped-def]
        V.choices  # noqa: B018 - the lazily built default first, so the handler set below restores to it
        with V.set_choices_handler(choices):
            return fn(*args, **kwargs)

    return call


def compiled(fn: F, mode: str) -> F:
    """fn itself for mode "none", else its torch.compile'd version (cached: one per (fn, mode))."""
    if mode == "none":
        return fn
    return _compile(fn, mode)  # type: ignore[return-value]
