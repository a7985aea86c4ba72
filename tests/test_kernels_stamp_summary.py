"""The stamp summary kernel (atlas_kernels.stamp_summary) against the torch summary it replaces
(StampReader._summary with the kernel off), on the random damaged states of tests/test_cuda_stamps_read.py (stamps
overwritten with right, wrong, pending and cleared positions; tables grown, shrunk, moved into the scratch block;
drafter rows damaged), every (slots, width) bound; then the whole fast read with the kernel on (graph path and
eager) against the reference read. Interpreted without a GPU (TRITON_INTERPRET=1), compiled on one."""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

import pytest
from test_cuda_stamps_read import _backend, _scramble, graph_path

from atlas.backends.cuda.stamp_read import summary_kernel
from atlas.plan import SeqWork, StepPlan

KERNEL = summary_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="atlas_kernels (triton) does not import here")
# the backends of test_cuda_stamps_read live on the CPU; on a GPU the compiled kernel reads copies of their tensors
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _live(backend, rng: random.Random, round_: int) -> None:
    store = backend.store
    for s in [s for s in list(store.seqs) if rng.random() < 0.4]:
        backend.release(s)
    work, blocks = [], iter(rng.sample(range(40), 40))
    for s in rng.sample(range(8), 3):
        if s in store.seqs or len(store.seqs) + len(work) >= 5:
            continue
        n = rng.randrange(2, 20)
        table = tuple(next(blocks) for _ in range(-(-n // 4) + rng.randrange(2)))
        work.append(SeqWork(s, tuple(rng.randrange(200) for _ in range(n)), 0, table, True))
    if work:
        backend.execute(StepPlan(round_, tuple(work)))


@pytest.mark.parametrize("drafter", [False, True])
def test_the_kernel_equals_the_torch_summary_on_random_states(drafter: bool) -> None:
    backend = _backend(drafter)
    store, reader = backend.store, backend.store.reader
    assert reader.kernel is None  # a CPU device: the torch summary unless asked
    rng = random.Random(5 + drafter)
    compared = 0
    for round_ in range(7):
        if round_ % 3 == 0:
            _live(backend, rng, round_)
        _scramble(backend, rng)
        states = list(store.seqs.values())
        if not states:
            continue
        reader._apply(reader._entries(states))  # the device tables up to date, as a read makes them
        hi = (max(s.slot for s in states) + 1, reader.pools.state_slots)[round_ % 2]  # the asked bound, all slots
        for width in sorted({1 + round_ % 3, max(len(s.table) for s in states) or 1, reader.cols}):
            want = reader._summary(hi, width, delta=False)
            got = KERNEL(reader.tables.to(DEV), reader.pools.paged_pos.to(DEV), reader.pools.stamps.to(DEV),
                         backend.drafter.pos.to(DEV) if backend.drafter is not None else None, hi=hi, width=width,
                         block_size=reader.bs).cpu()
            assert got.dtype == want.dtype and torch.equal(got, want), (round_, hi, width)
            compared += 1
    assert compared >= 9


@pytest.mark.skipif(DEV == "cuda", reason="a CPU store's read through the interpreted kernel (on a GPU: "
                    "tests/test_cuda_stamps_read.py's graph read runs the compiled one)")
@pytest.mark.parametrize("graphs", [False, True])
def test_the_read_with_the_kernel_equals_the_reference(graphs: bool) -> None:
    backend = _backend(True)
    store = backend.store
    store.reader.kernel = KERNEL
    if graphs:
        graph_path(store)
    rng = random.Random(31 + graphs)
    for round_ in range(7):
        if round_ % 3 == 0:
            _live(backend, rng, round_)
        _scramble(backend, rng)
        asked = rng.sample(range(8), rng.randrange(1, 8))
        assert store.read_cursors(asked) == store.read_cursors_reference(asked)


def test_the_kernel_refuses_a_width_past_the_tables() -> None:
    backend = _backend(False)
    reader = backend.store.reader
    with pytest.raises(ValueError, match="width 99 is past the tables' 12 block columns"):
        KERNEL(reader.tables.to(DEV), reader.pools.paged_pos.to(DEV), reader.pools.stamps.to(DEV), None, hi=1,
               width=99, block_size=reader.bs)
