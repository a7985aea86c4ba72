"""State machines refuse before mutating; events round-trip and upcast; digests are stable and sensitive."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from atlas.config import EngineConfig, derive_capacities
from atlas.errors import InvariantViolation, TransitionRefused, UnknownEvent
from atlas.sampling.params import SamplingParams
from atlas.state import events as ev
from atlas.state.control import ControlState
from atlas.state.invariants import audit, check_invariants
from atlas.state.machines import Phase

CAPS = derive_capacities(EngineConfig(max_seq_len=64, max_batch_size=4, prefill_chunk_tokens=16,
                                      block_size=8, num_kv_blocks=10))


def _arrive(state: ControlState, request_id: str, prompt_len: int, max_new: int = 8) -> int:
    seq_id = state.next_seq_id
    state.apply(ev.RequestArrived(request_id, seq_id, list(range(1, prompt_len + 1)),
                                  SamplingParams(max_tokens=max_new).to_json(), max_new))
    return seq_id


def test_a_prefill_then_decode_moves_every_cursor_together() -> None:
    state = ControlState.create(CAPS)
    s = _arrive(state, "a", 10)
    state.apply(ev.StepPlanned(0, (s,), (s,), (10,), ((s, 0, 1),), (), ()))
    state.apply(ev.StepExecuted(0, (42,)))
    seq = state.seqs[s]
    assert seq.cursor.tokens[-1] == 42 and seq.cursor.computed == 10 and seq.qsa.ingested == 10
    assert seq.cursor.phase is Phase.RUNNING and seq.blocks == [0, 1]
    assert seq.cursor.decoding and not seq.cursor.prefilling
    check_invariants(state, (s,), 0)
    audit(state, 0)
    state.apply(ev.StepPlanned(1, (), (s,), (1,), (), (), ()))
    state.apply(ev.StepExecuted(1, (43,)))
    assert (seq.cursor.computed, seq.qsa.ingested, len(seq.cursor.tokens)) == (11, 11, 12)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (lambda s: ev.StepPlanned(1, (s,), (s,), (10,), ((s, 1),), (), ()), "KV written past"),
        (lambda s: ev.StepPlanned(1, (s,), (s,), (11,), ((s, 1, 2),), (), ()), "fed tokens beyond"),
        (lambda s: ev.StepPlanned(1, (), (s,), (10,), ((s, 1, 2),), (), ()), "neither running nor admitted"),
        (lambda s: ev.StepPlanned(1, (s,), (s,), (10,), ((s, 1, 0),), (), ()), "not free"),
        (lambda s: ev.StepPlanned(1, (s,), (s,), (10,), ((s, 1, 2),), (7,), ()), "releases exactly"),
    ],
)
def test_a_refused_plan_changes_nothing(bad: Any, why: str) -> None:
    state = ControlState.create(CAPS)
    s = _arrive(state, "a", 10)
    other = _arrive(state, "b", 3)
    state.apply(ev.StepPlanned(0, (other,), (other,), (3,), ((other, 0),), (), ()))
    state.apply(ev.StepExecuted(0, (7,)))
    before = copy.deepcopy(state)
    with pytest.raises(TransitionRefused, match=why):
        state.apply(bad(s))
    assert state == before and state.digest() == before.digest()


def test_a_refused_execution_changes_nothing() -> None:
    state = ControlState.create(CAPS)
    a = _arrive(state, "a", 3)
    b = _arrive(state, "b", 10)
    state.apply(ev.StepPlanned(0, (a, b), (a, b), (3, 4), ((a, 0), (b, 1)), (), ()))
    before = copy.deepcopy(state)
    with pytest.raises(TransitionRefused, match="sampled exactly when"):
        state.apply(ev.StepExecuted(0, (5, 6)))  # b fed 4 of 10 tokens: nothing may be sampled for it
    assert state == before and state.seqs[a].cursor.computed == 0


def test_allocating_a_used_block_is_refused_before_anything_moves() -> None:
    state = ControlState.create(CAPS)
    a = _arrive(state, "a", 3)
    b = _arrive(state, "b", 3)
    state.apply(ev.StepPlanned(0, (a,), (a,), (3,), ((a, 0),), (), ()))
    state.apply(ev.StepExecuted(0, (1,)))
    before = copy.deepcopy(state)
    with pytest.raises(TransitionRefused, match="not free"):
        state.apply(ev.StepPlanned(1, (b,), (b,), (3,), ((b, 0),), (), ()))
    assert state == before


def test_preemption_resets_every_cursor_frees_blocks_and_requeues_in_arrival_order() -> None:
    state = ControlState.create(CAPS)
    a = _arrive(state, "a", 9)
    b = _arrive(state, "b", 2)
    state.apply(ev.StepPlanned(0, (a, b), (a, b), (9, 2), ((a, 0, 1), (b, 2)), (), ()))
    state.apply(ev.StepExecuted(0, (4, 5)))
    c = _arrive(state, "c", 2)
    state.apply(ev.SequencePreempted(a, 2, "kv blocks exhausted"))
    seq = state.seqs[a]
    assert (seq.cursor.computed, seq.qsa.ingested, seq.blocks, seq.on_device) == (0, 0, [], False)
    assert seq.cursor.tokens[-1] == 4  # generated tokens are kept: the sequence is recomputed
    assert state.waiting == [a, c] and state.running == [b]
    assert state.pool.used == 1
    audit(state, 0)
    with pytest.raises(TransitionRefused, match="frees every block"):
        state.apply(ev.SequencePreempted(b, 0, "kv blocks exhausted"))


def test_nothing_is_emitted_after_finish() -> None:
    state = ControlState.create(CAPS)
    a = _arrive(state, "a", 3)
    state.apply(ev.StepPlanned(0, (a,), (a,), (3,), ((a, 0),), (), ()))
    state.apply(ev.StepExecuted(0, (1,)))
    state.apply(ev.RequestFinished(a, "stop", "eos"))
    assert state.pending_release == [a] and state.pool.used == 0
    with pytest.raises(TransitionRefused, match="not live"):
        state.apply(ev.StepPlanned(1, (), (a,), (1,), (), (a,), ()))
    with pytest.raises(TransitionRefused, match="not live"):
        state.apply(ev.RequestFinished(a, "length", "again"))


def test_an_invariant_violation_names_the_event_machine_and_fields() -> None:
    state = ControlState.create(CAPS)
    a = _arrive(state, "a", 3)
    state.apply(ev.StepPlanned(0, (a,), (a,), (3,), ((a, 0),), (), ()))
    state.apply(ev.StepExecuted(0, (1,)))
    state.seqs[a].qsa.ingested = 2  # a rewind of the sequence that forgot the indexer
    with pytest.raises(InvariantViolation) as info:
        check_invariants(state, (a,), 17)
    v = info.value
    assert (v.event_index, v.machine) == (17, "QsaCursor")
    assert v.fields == {"seq_id": a, "ingested": 2, "computed": 3}
    assert "event 17" in str(v) and "ingested=2" in str(v)


def test_events_round_trip_through_json() -> None:
    samples = [
        ev.RequestArrived("r", 0, (1, 2), SamplingParams(stop=("x",)).to_json(), 5),
        ev.StepPlanned(3, (1,), (1, 2), (4, 1), ((1, 7, 8),), (0,), (5,)),
        ev.StepExecuted(3, (9, -1)),
        ev.EngineFaulted(3, True, "boom", False),
    ]
    for e in samples:
        import json

        back = ev.decode(e.kind, e.version, json.loads(e.payload_json()))
        assert back == e


def test_old_versions_upcast_on_read() -> None:
    @ev.event("test_widget", 3)
    class Widget(ev.Event):
        name: str
        size: int
        colour: str

    @ev.upcaster("test_widget", 1)
    def _v1(p: dict) -> dict:
        return {"name": p["label"], "size": p["size"]}

    @ev.upcaster("test_widget", 2)
    def _v2(p: dict) -> dict:
        return {**p, "colour": "grey"}

    try:
        assert ev.decode("test_widget", 1, {"label": "w", "size": 2}) == Widget("w", 2, "grey")
        assert ev.decode("test_widget", 3, {"name": "w", "size": 2, "colour": "red"}) == Widget("w", 2, "red")
        with pytest.raises(UnknownEvent, match="newer"):
            ev.upcast("test_widget", 4, {})
    finally:
        del ev.EVENT_TYPES["test_widget"], ev.UPCASTERS[("test_widget", 1)], ev.UPCASTERS[("test_widget", 2)]


def test_digest_is_stable_and_moves_with_any_field() -> None:
    def run(token: int) -> list[str]:
        state = ControlState.create(CAPS)
        a = _arrive(state, "a", 3)
        digests = [state.digest()]
        state.apply(ev.StepPlanned(0, (a,), (a,), (3,), ((a, 0),), (), ()))
        digests.append(state.digest())
        state.apply(ev.StepExecuted(0, (token,)))
        digests.append(state.digest())
        return digests

    first, again, other = run(5), run(5), run(6)
    assert first == again
    assert first[:2] == other[:2] and first[2] != other[2]
    assert len(set(first)) == 3
