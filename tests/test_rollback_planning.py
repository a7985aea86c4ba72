"""The control plane's side of rollback, no model: SsmRing placement, snapshot orders, rollback plans and their
typed declines, and the rolled_back / boundary_snapshotted transitions refusing before they mutate."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from atlas.config import EngineConfig, derive_capacities
from atlas.engine.rollback import DeclineReason, RollbackDecline, RollbackPlan, plan_rollback, plan_snapshots
from atlas.errors import TransitionRefused
from atlas.sampling.params import SamplingParams
from atlas.state import events as ev
from atlas.state.control import ControlState
from atlas.state.invariants import audit
from atlas.state.machines import SsmRing

CAPS = derive_capacities(EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=16, block_size=4,
                                      num_kv_blocks=32, ring_slots=2, snapshot_interval=4))
CURSORS = ("kv_tokens", "qsa_ingested", "ssm_position", "ple_position")


def test_the_ring_fills_free_slots_then_evicts_the_oldest() -> None:
    ring = SsmRing(2)
    assert ring.place() == (0, -1)
    ring.record(10, 0, -1)
    assert ring.place() == (1, -1)
    ring.record(14, 1, -1)
    assert ring.place() == (0, 10)
    ring.record(18, 0, 10)
    assert ring.snapshots == [(14, 1), (18, 0)]
    assert ring.latest_before(18) == (14, 1) and ring.latest_before(14) is None
    with pytest.raises(TransitionRefused, match="strictly increase"):
        ring.record(18, 1, 14)
    with pytest.raises(TransitionRefused, match="where place"):
        ring.record(30, 0, 14)  # slot 1 holds the oldest, not slot 0
    assert ring.snapshots == [(14, 1), (18, 0)]
    ring.truncate_after(15)
    assert ring.snapshots == [(14, 1)]
    with pytest.raises(TransitionRefused, match="disabled"):
        SsmRing(0).place()


def decoding(generated: int, *, prompt: int = 6, stream: bool = False) -> tuple[ControlState, int]:
    """A sequence that prefilled `prompt` tokens and decoded `generated` - 1 more, snapshotting like the engine."""
    state = ControlState.create(CAPS)
    s = state.next_seq_id
    state.apply(ev.RequestArrived("r", s, list(range(1, prompt + 1)), SamplingParams(max_tokens=40).to_json(), 40,
                                  stream))
    for step in range(generated):
        seq = state.seqs[s]
        fed = prompt if step == 0 else 1
        need = -(-(seq.cursor.computed + fed) // CAPS.block_size) - len(seq.blocks)
        alloc = ((s, *list(state.pool.free)[-need:][::-1]),) if need > 0 else ()
        planned = ev.StepPlanned(step, (s,) if step == 0 else (), (s,), (fed,), alloc, (), ())
        state.apply(planned)
        orders = plan_snapshots(state.seqs, planned.seqs, planned.fed, CAPS.snapshot_interval)
        state.apply(ev.StepExecuted(step, (100 + step % 3,)))
        for o in orders:
            state.apply(ev.BoundarySnapshotted(step, o.seq_id, o.position, o.slot, o.evicted))
    audit(state, -1)
    return state, s


def test_snapshots_are_taken_at_the_prompt_end_and_every_interval_past_it() -> None:
    state, s = decoding(12)
    # boundaries 6, 10, 14 were computed; two slots keep the newest two
    assert state.seqs[s].ring.snapshots == [(10, 1), (14, 0)]


def test_a_rollback_plan_targets_the_newest_snapshot_before_the_loop() -> None:
    state, s = decoding(12)
    seq = state.seqs[s]
    plan = plan_rollback(seq, 13, max_rollbacks=2, block_size=4)
    assert plan == RollbackPlan(s, 10, 1, 13, seq.cursor.tokens[13], len(seq.blocks) - 4)
    with pytest.raises(ValueError):
        plan_rollback(seq, 6, max_rollbacks=2, block_size=4)  # at the prompt: nothing generated to drop
    with pytest.raises(ValueError):
        plan_rollback(seq, len(seq.cursor.tokens), max_rollbacks=2, block_size=4)


@pytest.mark.parametrize("setup, keep, reason", [
    (dict(stream=True), 13, DeclineReason.STREAMED),
    ({}, 9, DeclineReason.NO_SNAPSHOT),  # the snapshot at 6 was evicted
    ({}, 10, DeclineReason.NO_SNAPSHOT),  # a boundary AT the target cannot resample it: needs one before
])
def test_declines_are_typed(setup: dict, keep: int, reason: DeclineReason) -> None:
    state, s = decoding(12, **setup)
    assert plan_rollback(state.seqs[s], keep, max_rollbacks=2, block_size=4) == RollbackDecline(s, reason, keep)


def test_exhausted_attempts_and_a_disabled_ring_decline() -> None:
    state, s = decoding(12)
    assert plan_rollback(state.seqs[s], 13, max_rollbacks=0, block_size=4).reason is DeclineReason.ATTEMPTS_EXHAUSTED
    state.seqs[s].ring.slots = 0
    assert plan_rollback(state.seqs[s], 13, max_rollbacks=2, block_size=4).reason is DeclineReason.RING_DISABLED


def rolled_back(state: ControlState, s: int, **change: Any) -> ev.RolledBack:
    plan = plan_rollback(state.seqs[s], 13, max_rollbacks=2, block_size=4)
    assert isinstance(plan, RollbackPlan)
    fields = dict(step=state.step, seq_id=s, boundary=plan.boundary, slot=plan.slot, keep=plan.keep,
                  ban_token=plan.ban_token, blocks_freed=plan.blocks_freed, period=3, attempt=1)
    return ev.RolledBack(**{**fields, **change})


def test_one_event_rewinds_every_cursor_and_frees_the_blocks_past_the_kept_tokens() -> None:
    state, s = decoding(12)
    seq = state.seqs[s]
    tokens, used, held = list(seq.cursor.tokens), state.pool.used, seq.cursor.computed
    state.apply(rolled_back(state, s))
    audit(state, -1)
    assert seq.cursor.tokens == tokens[:13] and seq.cursor.computed == seq.qsa.ingested == 10
    assert len(seq.blocks) == 4 and state.pool.used == used - 1
    assert seq.ring.snapshots == [(10, 1)] and seq.banned == {13: (tokens[13],)} and seq.rollbacks == 1
    # the data plane's restore is queued for the next plan, with the cursors it holds before it
    (order,) = state.orders.rollbacks
    assert (order.seq_id, order.slot, order.position, order.held) == (s, 1, 10, (held, held, held, held, 0))


@pytest.mark.parametrize("change, why", [
    (dict(slot=0), "does not hold"),
    (dict(boundary=14, slot=0), "does not hold|boundary < keep"),
    (dict(ban_token=-5), "banned token"),
    (dict(blocks_freed=0), "exactly the blocks"),
    (dict(attempt=2), "count up from 1"),
])
def test_a_refused_rollback_changes_nothing(change: dict, why: str) -> None:
    state, s = decoding(12)
    bad = rolled_back(state, s, **change)
    before, digest = copy.deepcopy(state), state.digest()
    with pytest.raises(TransitionRefused, match=why):
        state.apply(bad)
    assert state.digest() == digest and state.seqs[s] == before.seqs[s] and state.pool == before.pool


def test_a_snapshot_off_the_computed_position_is_refused() -> None:
    state, s = decoding(3)
    slot, evicted = state.seqs[s].ring.place()
    with pytest.raises(TransitionRefused, match="computed tokens"):
        state.apply(ev.BoundarySnapshotted(state.step, s, 7, slot, evicted))


def test_a_v1_arrival_upcasts_to_a_non_streaming_request() -> None:
    payload = {"request_id": "old", "seq_id": 0, "prompt": [1, 2], "params": SamplingParams().to_json(), "max_new": 4}
    e = ev.decode("request_arrived", 1, payload)
    assert isinstance(e, ev.RequestArrived) and e.stream is False


def test_a_ring_on_a_backend_without_one_is_refused_at_load() -> None:
    from atlas.backends.base import Capabilities
    from atlas.backends.null import ByteTokenizer
    from atlas.engine.engine import Engine
    from atlas.errors import CapabilityError

    class NoRing:
        name = "no-ring"
        capabilities = Capabilities()

    with pytest.raises(CapabilityError, match="'no-ring' does not support the snapshot ring for rollback: set "
                                              "ring_slots 0 \\(got 2"):
        Engine(NoRing(), tokenizer=ByteTokenizer(), config=EngineConfig(ring_slots=2))  # type: ignore[arg-type]
    Engine(NoRing(), tokenizer=ByteTokenizer(), config=EngineConfig(ring_slots=0))  # type: ignore[arg-type]
