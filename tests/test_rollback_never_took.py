"""The "never took" property, bitwise on the CPU backend and atlas-tiny: after rolling back to boundary b, every
cursor, the GDN conv + recurrent state, the PLE context + short-conv state, the QSA raw keys, the KV of the
kept positions and the next logits equal those of a fresh sequence fed the same b tokens; including boundaries
past the QSA inert bound (19 for atlas-tiny), where selection is active. A refused restore changes nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas.backends.cpu import CpuBackend
from atlas.backends.cpu.runner import Chunk
from atlas.engine.rollback import is_boundary
from atlas.errors import RestoreRefused
from atlas.model import load_model
from atlas.plan import RingRestore, RingSnapshot, SeqWork, StepPlan
from atlas.state.machines import SsmRing

BLOCK = 16
TABLE = tuple(range(8))  # 128 positions


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


def fed_with_snapshots(tiny, tokens: list[int], prompt_len: int, interval: int,
                       slots: int) -> tuple[CpuBackend, SsmRing]:
    """Prefill the prompt, then decode the rest one token per step, snapshotting on every boundary the way
    the engine plans it (SsmRing.place)."""
    backend = CpuBackend(tiny, num_kv_blocks=len(TABLE), block_size=BLOCK, ring_slots=slots)
    ring = SsmRing(slots)
    start, step = 0, 0
    for end in [prompt_len, *range(prompt_len + 1, len(tokens) + 1)]:
        orders = ()
        if is_boundary(end, prompt_len, interval):
            slot, evicted = ring.place()
            orders = (RingSnapshot(0, end, slot),)
        work = SeqWork(0, tuple(tokens[start:end]), start, TABLE, sample=False)
        backend.execute(StepPlan(step, (work,), snapshots=orders))
        for o in orders:
            ring.record(o.position, o.slot, ring.place()[1])
        start, step = end, step + 1
    return backend, ring


def fresh(tiny, tokens: list[int]) -> CpuBackend:
    backend = CpuBackend(tiny, num_kv_blocks=len(TABLE), block_size=BLOCK)
    backend.forward([Chunk(0, tokens, 0, TABLE)])
    return backend


def assert_same_state(a: CpuBackend, b: CpuBackend, positions: int) -> None:
    assert a.cursors(0) == b.cursors(0)
    if positions == a.cursors(0).kv_tokens:
        assert a.store.state_digest(0) == b.store.state_digest(0)
    sa, sb = a.store.seqs[0], b.store.seqs[0]
    for name in ("gdn_conv", "gdn_recurrent", "ple_conv", "qsa_keys"):
        da, db = getattr(sa, name), getattr(sb, name)
        assert da.keys() == db.keys()
        for layer in da:
            assert torch.equal(da[layer], db[layer]), (name, layer)
    assert torch.equal(sa.ple_context, sb.ple_context)
    slots = a.kv.slots(TABLE, 0, positions)
    for layer in a.kv.keys:
        ka, va = a.kv.read(layer, slots)
        kb, vb = b.kv.read(layer, slots)
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@settings(max_examples=8, deadline=None)
@given(data=st.data(), prompt_len=st.integers(3, 24), extra=st.integers(6, 40), interval=st.integers(2, 9),
       slots=st.integers(1, 4))
def test_after_rollback_to_b_the_sequence_is_a_fresh_one_fed_b_tokens(tiny, data, prompt_len: int, extra: int,
                                                                      interval: int, slots: int) -> None:
    tokens = data.draw(st.lists(st.integers(0, 255), min_size=prompt_len + extra, max_size=prompt_len + extra))
    rolled, ring = fed_with_snapshots(tiny, tokens, prompt_len, interval, slots)
    boundary, slot = data.draw(st.sampled_from(ring.snapshots))
    cursors = rolled.store.restore(RingRestore(0, slot, boundary))
    assert cursors.kv_tokens == cursors.qsa_ingested == cursors.ssm_position == cursors.ple_position == boundary
    assert all(p <= boundary for p in rolled.store.ring.positions(0).values())
    reference = fresh(tiny, tokens[:boundary])
    assert_same_state(rolled, reference, boundary)
    # the next logits, and the ones after, are the fresh sequence's to the bit (selection active past 19)
    follow = tokens[boundary : boundary + 4] or [7]
    nxt = [Chunk(0, follow, boundary, TABLE)]
    assert torch.equal(rolled.forward(nxt)[0], reference.forward(nxt)[0])


def test_rollback_past_the_qsa_inert_bound_is_exact(tiny) -> None:
    assert tiny.spec.qsa is not None and tiny.spec.qsa.inert_bound == 19
    tokens = [(i * 37 + 11) % 256 for i in range(70)]
    rolled, ring = fed_with_snapshots(tiny, tokens, prompt_len=10, interval=12, slots=3)
    assert [p for p, _ in ring.snapshots] == [46, 58, 70]  # 10, 22, 34 were evicted: the newest three stay
    boundary, slot = ring.snapshots[0]
    rolled.store.restore(RingRestore(0, slot, boundary))
    reference = fresh(tiny, tokens[:boundary])
    assert_same_state(rolled, reference, boundary)
    nxt = [Chunk(0, tokens[boundary:], boundary, TABLE)]  # crosses more blocks, all selection-active
    assert torch.equal(rolled.forward(nxt)[0], reference.forward(nxt)[0])


def test_a_refused_restore_changes_nothing(tiny) -> None:
    tokens = [(i * 13 + 5) % 256 for i in range(30)]
    backend, ring = fed_with_snapshots(tiny, tokens, prompt_len=8, interval=5, slots=2)
    (p0, s0), (p1, s1) = ring.snapshots
    before = fresh(tiny, tokens)
    for slot, position in ((s0, p1), (s1, p0), (5, p0), (s0, 999)):
        with pytest.raises(RestoreRefused):
            backend.store.restore(RingRestore(0, slot, position))
        assert_same_state(backend, before, len(tokens))
        assert backend.store.ring.positions(0) == {s0: p0, s1: p1}
    with pytest.raises(RestoreRefused):
        backend.store.restore(RingRestore(3, s0, p0))  # a sequence the backend does not hold


def test_a_misplaced_snapshot_order_fails_the_step_before_anything_moves(tiny) -> None:
    backend = CpuBackend(tiny, num_kv_blocks=len(TABLE), block_size=BLOCK, ring_slots=2)
    work = SeqWork(0, (1, 2, 3), 0, TABLE, sample=False)
    with pytest.raises(ValueError, match="not where its work ends"):
        backend.execute(StepPlan(0, (work,), snapshots=(RingSnapshot(0, 2, 0),)))
    with pytest.raises(ValueError, match="ring slot 2"):
        backend.execute(StepPlan(0, (work,), snapshots=(RingSnapshot(0, 3, 2),)))
    assert not backend.has_sequence(0) and backend.store.ring.positions(0) == {}
