"""Programmatic dependent launch (PDL) for the decode step's kernels: the one place that decides whether a launch
uses it, and the kernels' prologue.

A kernel launched with PDL (CUDA's programmatic-stream-serialization attribute, Triton's `launch_pdl=True`) may start
while the kernel before it in the stream is still running: its launch and the blocks' setup overlap that kernel's
tail (a batch-1 decode step is ~840 kernels of ~2-3 us, near a kernel's latency floor). Correctness rests on the
prologue `pdl_start`: `griddepcontrol.wait` before the program's first global load *or store* (the previous kernels
may still be writing what it reads, or reading what it is about to overwrite), then
`griddepcontrol.launch_dependents`, which lets the next PDL-launched kernel launch early and wait at its own
`griddepcontrol.wait`; the wait returns once every prerequisite grid has completed and its memory is visible, so
whatever precedes the kernel (cuBLAS, Inductor, ours) is safe. With PDL off the kernels are compiled without the
prologue and launched as before.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def interpreted() -> bool:
    """Whether Triton runs on the CPU interpreter (TRITON_INTERPRET=1): no inline PTX, no launch attributes."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def enabled(requested: bool, device: torch.device | str) -> bool:
    """PDL for a launch on `device`: only when requested, not under the interpreter, and on a CUDA device of compute
    capability 9.0 or more (Hopper's griddepcontrol; older GPUs have no such instruction)."""
    if not requested or interpreted():
        return False
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def launch(pdl: bool) -> dict[str, bool]:
    """The launch's keyword arguments: launch_pdl=True with PDL, none without (the launch exactly as before)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A PDL kernel's first statement, before any global load or store: wait for the kernels before it (their writes
    visible, their reads done), then let the next kernel launch. Nothing at all without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
