"""The hypothesis state machines of the CPU reference (rollback, speculation across the QSA bound, multi-turn
prefix/carry) on the CUDA backend's fp32 parity mode: through its CPU path here (fewer examples: it is slower
per step than the CPU backend), and on the GPU (marked cuda) with the CPU reference's example counts.

"Never took" on the CUDA backend: after a rollback and the re-feed, every cursor and stamp equals a fresh
sequence fed the kept tokens one at a time, and the per-slot state (GDN conv + recurrent, PLE conv and n-gram
context) equals it to 1e-5: not bitwise, because the rolled-back sequence was prefilled in chunks and decoded in
batches, whose GEMMs round differently from a fresh one-token feed's (the CPU reference feeds every token alone,
which is what makes its check bitwise)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from test_prefix_machine import PrefixMachine
from test_rollback_stateful import CONFIG, TINY, RollbackMachine, SpeculativeRollbackMachine
from test_spec_machine import SpeculativeMachine

from atlas.backends.cuda import CudaBackend
from atlas.plan import SeqWork, StepPlan

CPU_PATH = {"device": "cpu", "cuda_graphs": False}
GPU = {"device": "cuda", "cuda_graphs": False}


def cuda_never_took(engine, seq_id: int, tokens: list[int], boundary: int) -> None:
    backend = engine.backend
    fresh = CudaBackend.for_capacities(TINY, engine.capacities, dtype=torch.float32, device=backend.device,
                                       cuda_graphs=False)
    table = tuple(range(-(-CONFIG.max_seq_len // CONFIG.block_size)))
    for i in range(boundary):  # through execute: the drafter builds its pair keys too
        fresh.execute(StepPlan(i, (SeqWork(seq_id, tuple(tokens[i : i + 1]), i, table, False),)))
    got, want = backend.cursors(seq_id), fresh.cursors(seq_id)
    assert got.as_tuple() == want.as_tuple() and sorted(got.stamps) == sorted(want.stamps), (got, want)
    a, b = backend.store.seqs[seq_id].slot, fresh.store.seqs[seq_id].slot
    for name, t in backend.pools.state.items():
        assert torch.allclose(t[a].double(), fresh.pools.state[name][b].double(), rtol=0, atol=1e-5), name
    if backend.drafter is not None:  # the MTP drafter's pair keys, rebuilt from the target's hidden
        rows = got.drafter_rows
        for pool, ref in ((backend.drafter.k, fresh.drafter.k), (backend.drafter.v, fresh.drafter.v)):
            for layer, t in pool.items():
                assert torch.allclose(t[a, :rows], ref[layer][b, :rows], rtol=0, atol=1e-5), layer


class _Cuda:
    backend_name = "cuda-fp32"
    backend_options = CPU_PATH

    def assert_never_took(self, seq_id: int, tokens: list[int], boundary: int) -> None:
        cuda_never_took(self.engine, seq_id, tokens, boundary)  # type: ignore[attr-defined]


class CudaRollbackMachine(_Cuda, RollbackMachine):
    pass


class CudaSpeculativeRollbackMachine(_Cuda, SpeculativeRollbackMachine):
    pass


class CudaSpeculativeMachine(_Cuda, SpeculativeMachine):
    pass


class CudaPrefixMachine(_Cuda, PrefixMachine):
    pass


def _few(examples: int, steps: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


CudaRollbackMachine.TestCase.settings = _few(4, 20)
CudaSpeculativeRollbackMachine.TestCase.settings = _few(3, 20)
CudaSpeculativeMachine.TestCase.settings = _few(5, 14)
CudaPrefixMachine.TestCase.settings = _few(3, 20)
TestCudaRollbackMachine = CudaRollbackMachine.TestCase
TestCudaSpeculativeRollbackMachine = CudaSpeculativeRollbackMachine.TestCase
TestCudaSpeculativeMachine = CudaSpeculativeMachine.TestCase
TestCudaPrefixMachine = CudaPrefixMachine.TestCase


# the GPU: the same machines compiled, with the CPU reference's example counts
_ON_GPU = pytest.mark.cuda


class GpuRollbackMachine(CudaSpeculativeRollbackMachine):
    backend_options = GPU


class GpuSpeculativeMachine(CudaSpeculativeMachine):
    backend_options = GPU


class GpuPrefixMachine(CudaPrefixMachine):
    backend_options = GPU


GpuRollbackMachine.TestCase.settings = _few(10, 30)
GpuSpeculativeMachine.TestCase.settings = _few(25, 14)
GpuPrefixMachine.TestCase.settings = _few(20, 25)
_needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
TestGpuRollbackMachine = _ON_GPU(_needs_gpu(GpuRollbackMachine.TestCase))
TestGpuSpeculativeMachine = _ON_GPU(_needs_gpu(GpuSpeculativeMachine.TestCase))
TestGpuPrefixMachine = _ON_GPU(_needs_gpu(GpuPrefixMachine.TestCase))
