"""The seventh control-plane pass (docs/CONTROL-PLANE.md): memos and reuses on the engine's step path give exactly
what they stand for."""

from __future__ import annotations

import random

from atlas.config import EngineConfig, derive_capacities
from atlas.hashing import mix64
from atlas.plan import CarryOrder, PrefixStore, RingRestore
from atlas.state.control import ControlState
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
