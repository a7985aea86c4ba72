"""Chunk offsets at every alignment the planner produces, through the scheduler's own batching (the engine's step,
not a chunk-splitting helper): generated prompts, arrival steps, block sizes, chunk budgets and prefill
alignments, on a backend that checks every planned chunk where its start becomes an address.

Per chunk: its start is a typed RowOffset (a decode of the batch columns' fast path, one row, may be an int), it
continues the sequence exactly where it stood (0 after a preemption), every row's KV slot through the block
table is the slot `atlas_kernels.rows.slot_of` gives, and no two rows of a step, nor any row and a live
sequence's earlier rows, share a slot. Per step: the tokens fit the budget. Per sequence: the prompt's chunks
cover it, each within the budget, and with aligned chunks (prefill_align A) each ends at a multiple of A or the
prompt's end. The CPU reference then prefills one prompt starting a chunk at every in-block alignment: the state
is, to the bit, a one-chunk prefill's."""

from __future__ import annotations

import pytest
import torch
from atlas_kernels.rows import RowOffset, check_rows, check_table_covers, slot_of
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from atlas.backends.cpu import CpuBackend
from atlas.backends.cpu.runner import Chunk
from atlas.backends.null import ByteTokenizer, NullBackend
from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.errors import CapacityError
from atlas.model import load_model
from atlas.plan import StepPlan, StepResult
from atlas.sampling.params import SamplingParams


class AddressingBackend(NullBackend):
    """The null backend, checking each planned chunk's start where it becomes KV slots."""

    def __init__(self, block_size: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.rows: dict[int, dict[int, int]] = {}  # seq_id -> position -> slot, of the rows it holds
        self.chunks: list[tuple[int, int, int, bool]] = []  # (seq_id, start, rows, typed)
        self.step_tokens: list[int] = []
        self.failures: list[AssertionError] = []

    def execute(self, plan: StepPlan) -> StepResult:
        try:
            self.check(plan)
        except AssertionError as exc:  # the engine would fail the step's requests: keep it for the test
            self.failures.append(exc)
            raise
        return super().execute(plan)

    def check(self, plan: StepPlan) -> None:
        bs = self.block_size
        for seq_id in (*plan.release, *plan.reset):
            self.rows.pop(seq_id, None)
        taken: dict[int, tuple[int, int]] = {}
        for w in plan.work:
            n = len(w.tokens) + len(w.drafts)
            typed = isinstance(w.start, RowOffset)
            assert typed or n == 1, f"sequence {w.seq_id}: a chunk of {n} rows at {w.start!r} is not typed"
            held = self.rows.setdefault(w.seq_id, {})
            if w.start == 0:
                held.clear()
            assert w.start == len(held), f"sequence {w.seq_id}: chunk at {w.start}, {len(held)} rows held"
            check_rows(w.start, n, len(w.block_table), bs)
            for i in range(n):
                p = w.start + i
                slot = slot_of(w.block_table, p, bs)
                assert slot == w.block_table[p // bs] * bs + p % bs
                assert slot not in taken, (w.seq_id, p, taken[slot])
                taken[slot] = (w.seq_id, p)
            for i in range(len(w.tokens)):
                held[w.start + i] = taken_slot = slot_of(w.block_table, w.start + i, bs)
                assert taken_slot in taken
            self.chunks.append((w.seq_id, int(w.start), len(w.tokens), typed))
        live = {s: (q, p) for q, rows in self.rows.items() for p, s in rows.items()}
        for slot, (seq_id, p) in taken.items():
            owner = live.get(slot)
            assert owner is None or owner == (seq_id, p), f"slot {slot}: {seq_id}@{p} over {owner}"
        self.step_tokens.append(sum(len(w.tokens) + len(w.drafts) for w in plan.work))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 3, 4, 8, 16]), budget=st.integers(1, 40), align=st.integers(0, 12),
       batch=st.integers(1, 4), blocks=st.integers(0, 40),
       prompts=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 70), st.integers(1, 6)), min_size=1, max_size=5))
def test_every_planned_chunk_addresses_its_own_rows(block_size: int, budget: int, align: int, batch: int,
                                                    blocks: int, prompts: list[tuple[int, int, int]]) -> None:
    try:
        config = EngineConfig(max_seq_len=80, max_batch_size=batch, prefill_chunk_tokens=budget,
                              block_size=block_size, prefill_align=align,
                              num_kv_blocks=-(-80 // block_size) + blocks if blocks else None)
        backend = AddressingBackend(block_size)
        engine = Engine(backend, tokenizer=ByteTokenizer(), config=config)
    except CapacityError:
        assume(False)
        return
    caps = engine.capacities
    lengths = {}
    for step in range(400):
        for k, (at, n, max_tokens) in enumerate(prompts):
            if at == step:
                engine.add_request(f"r{k}", [(7 * k + i) % 250 for i in range(n)],
                                   SamplingParams(max_tokens=min(max_tokens, 80 - n), ignore_eos=True))
                lengths[engine.state.by_request[f"r{k}"]] = n
        engine.step()
        if step > 6 and not engine.has_unfinished():
            break
    if backend.failures:
        raise backend.failures[0]
    assert not engine.has_unfinished()
    assert max(backend.step_tokens) <= caps.max_batch_tokens
    for seq_id, n in lengths.items():
        prefill = [(start, rows) for s, start, rows, _ in backend.chunks if s == seq_id and start < n]
        covered = 0
        for start, rows in prefill:
            covered = start + rows if start else rows  # a preemption starts over at 0
            assert rows <= caps.max_batch_tokens
            if caps.prefill_align and start + rows < n:
                assert (start + rows) % caps.prefill_align == 0, (start, rows, caps.prefill_align)
        assert covered >= n


def test_row_offsets_are_not_counts() -> None:
    o = RowOffset(12)
    assert isinstance(o + 4, RowOffset) and o + 4 == 16 and isinstance(3 + o, RowOffset)
    assert type(RowOffset(20) - o) is int and isinstance(o - 2, RowOffset) and type(o - 13) is int
    assert o.bytes(256) == 3072 and f"{o}" == "12"
    with pytest.raises(TypeError):
        _ = o * 256  # a byte address is explicit: o.bytes(pitch)
    with pytest.raises(TypeError):
        _ = o + RowOffset(1)
    with pytest.raises(ValueError):
        RowOffset(-1)
    with pytest.raises(ValueError, match="block table has 2 blocks"):
        check_rows(RowOffset(6), 3, 2, 4)
    with pytest.raises(TypeError):
        check_rows(6.0, 1, 4, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows up to 40"):
        check_table_covers(2, 16, 40, what="kernel")


TINY = load_model("atlas-tiny")


@pytest.mark.parametrize("block_size", [4, 8])
def test_a_prompt_continued_at_every_in_block_offset_is_a_one_chunk_prefill(block_size: int) -> None:
    torch.set_num_threads(1)
    ids = [(5 * i + 11) % 250 for i in range(2 * block_size + 3)]
    table = tuple(range(8))
    one = CpuBackend(TINY, num_kv_blocks=8, block_size=block_size)
    one.forward([Chunk(0, ids, 0, table)])
    want = one.store.state_digest(0)
    for cut in range(1, block_size + 1):  # the continuation chunk starts at every offset inside a block
        two = CpuBackend(TINY, num_kv_blocks=8, block_size=block_size)
        two.forward([Chunk(0, ids[:cut], 0, table)])
        two.forward([Chunk(0, ids[cut:], cut, table)])
        assert two.store.state_digest(0) == want, cut
