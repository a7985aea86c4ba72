"""Memos and reuses on the engine's step path give exactly
what they stand for."""

from __future__ import annotations

import random

import pytest
from fixtures import null_workload

from atlas.config import EngineConfig, derive_capacities
from atlas.engine.records import RecordingSink
from atlas.hashing import hash64, hash64_after, ints_key, mix64
from atlas.plan import CarryOrder, PrefixStore, RingRestore
from atlas.state.control import ControlState
from atlas.state.events import StepPlanned
from atlas.state.invariants import check_invariants
from atlas.state.orders import PlanOrders, empty_or_new


def _digest_spec(s: ControlState) -> str:
    """ControlState.digest as specified (four mix64 rounds, no memo)."""
    g = mix64(s.step ^ (s.pool.used << 20) ^ (s.next_seq_id << 40))
    g = mix64(g ^ (len(s.waiting) << 32) ^ len(s.running) ^ (s.finished_count << 16))
    g = mix64(g ^ (len(s.pending_release) << 8) ^ len(s.pending_faults) ^ (s.dead << 62))
    g = mix64(g ^ s.inflight_hash ^ s.outcomes_hash)
    if s.prefix is not None:
        carried = -1 if s.carry is None else s.carry.last_pair_key
        g = mix64(g ^ len(s.prefix.blocks) ^ (len(s.prefix.snapshots) << 24) ^ (carried << 40))
    return f"{g ^ s.seq_digest:016x}"


def test_the_digest_memo_equals_the_specified_digest_whichever_counter_moves() -> None:
    state = ControlState.create(derive_capacities(EngineConfig(max_seq_len=64, max_batch_size=4)))
    rng = random.Random(7)
    moves = [
        lambda: setattr(state, "step", state.step + 1),
        lambda: setattr(state.pool, "used", rng.randrange(0, 50)),
        lambda: setattr(state, "next_seq_id", state.next_seq_id + 1),
        lambda: state.waiting.append(rng.randrange(100)),
        lambda: state.running.append(rng.randrange(100)),
        lambda: setattr(state, "finished_count", state.finished_count + 1),
        lambda: state.pending_release.append(1),
        lambda: state.pending_faults.append(("step_error", None)),
        lambda: setattr(state, "dead", not state.dead),
        lambda: setattr(state, "inflight_hash", rng.getrandbits(64)),
        lambda: setattr(state, "outcomes_hash", rng.getrandbits(64)),
        lambda: setattr(state, "seq_digest", rng.getrandbits(64)),
    ]
    seen = set()
    for i in range(600):
        if i % 3:  # some digests twice in a row (the memo's hit), some after one counter moved (its miss)
            moves[rng.randrange(len(moves))]()
        got = state.digest()
        assert got == _digest_spec(state), i
        seen.add(got)
    assert len(seen) > 300
    # each counter alone moves the digest from a memo built on the others (a key without it would not)
    for move in moves[:9]:
        before = state.digest()
        move()
        assert state.digest() == _digest_spec(state) != before


def test_empty_orders_are_kept_and_any_order_makes_new_ones() -> None:
    empty = PlanOrders()
    assert empty_or_new(empty) is empty
    filled = [PlanOrders(stores=[PrefixStore(1, 4, 9, -1)]), PlanOrders(rollbacks=[RingRestore(1, 0, 4, (4, 4, 4, 4, 0))]),
              PlanOrders(carry_store=3), PlanOrders(carry_drop=True)]
    filled.append(PlanOrders())
    filled[-1].restores.append(object())  # type: ignore[arg-type]
    for orders in filled:
        fresh = empty_or_new(orders)
        assert fresh is not orders and fresh == PlanOrders() and fresh.carry == CarryOrder(False, -1)


def test_hash64_after_is_hash64_of_head_and_tail() -> None:
    rng = random.Random(3)
    for n in (0, 1, 7, 63, 64, 127, 128, 129, 500):
        head = rng.randbytes(n)
        finish = hash64_after(b"atlas.plan", head)
        for m in (0, 1, 24, 128, 300):
            tail = rng.randbytes(m)
            assert finish(tail) == hash64(b"atlas.plan", head + tail)
            assert finish(tail) == hash64(b"atlas.plan", head + tail)  # the absorbed head is copied, never moved


@pytest.mark.parametrize("columns", [True, False])
def test_every_plan_key_is_the_plans_ints_key(columns: bool) -> None:
    """After every StepPlanned of a null-engine run (batches of 1-20 rows, allocations, finishes, arrivals), with the
    batch columns on and off, the in-flight plan's share of the digest is ints_key of its rows: the objects' path
    memo (the last plan's rows) and the columns' (the head absorbed once, the key of a plan with nothing after it)."""
    sink = RecordingSink()
    if columns:
        caps = null_workload.run(24, lambda i: 14 + i % 9, sink=sink)
    else:  # fewer, longer requests: runs of plans with the same rows (the memo's hits)
        caps = null_workload.run(4, lambda i: 60 + i, sink=sink)
    state = ControlState.create(caps)
    state.batch_cache = columns
    checked = through_columns = 0
    for index, (_, _, e, digest) in enumerate(sink.rows):
        check_invariants(state, state.apply(e), index)
        assert state.digest() == digest
        if isinstance(e, StepPlanned):
            expected = ints_key(b"atlas.plan", (e.seqs, e.fed, *e.alloc, e.release, e.reset, e.restored, *e.drafts))
            assert state.inflight_hash == expected, index
            checked += 1
            through_columns += state.batch is not None
    assert checked > 30
    assert through_columns > 8 if columns else through_columns == 0
