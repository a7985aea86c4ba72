"""StepExecuted's one-pass advance (atlas.state.advance): a refusal found at any sequence leaves every sequence as
it was (the pass puts back what it moved for those before it), with the two-pass path's refusal; a commit leaves
the state the two-pass path leaves (fields, fingerprints, digest). Batches of 16+ sequences, so the column
fingerprints are on too."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atlas.config import EngineConfig, derive_capacities
from atlas.errors import TransitionRefused
from atlas.sampling.params import SamplingParams
from atlas.state import advance, steps
from atlas.state import events as ev
from atlas.state.control import ControlState

CAPS = derive_capacities(EngineConfig(max_seq_len=64, max_batch_size=20, prefill_chunk_tokens=160,
                                      block_size=8, num_kv_blocks=80))


def _running(k: int, max_new: int = 6) -> ControlState:
    """k running sequences, each with a prompt of 5 fed and one token sampled (one block of 8 each)."""
    state = ControlState.create(CAPS)
    for i in range(k):
        state.apply(ev.RequestArrived(f"r{i}", i, [1 + i] * 5, SamplingParams(max_tokens=max_new).to_json(), max_new))
    ids = tuple(range(k))
    state.apply(ev.StepPlanned(0, ids, ids, (5,) * k, tuple((s, s) for s in ids), (), ()))
    state.apply(ev.StepExecuted(0, (7,) * k))
    return state


def _fields(state: ControlState) -> tuple:
    return (state.seq_digest, state.inflight, [(s.cursor.tokens, s.cursor.computed, s.cursor.token_hash,
                                                s.qsa.ingested, s.fingerprint) for s in state.seqs.values()])


def _refusal(state: ControlState, tokens: tuple[int, ...]) -> tuple | None:
    try:
        state.apply(ev.StepExecuted(1, tokens))
    except TransitionRefused as exc:
        return exc.machine, exc.why, exc.fields
    return None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(16, 20), data=st.data())
def test_a_refusal_anywhere_leaves_every_sequence_as_it_was(k: int, data: st.DataObject) -> None:
    state = _running(k)
    fed = [1] * k
    tokens = [8] * k
    bad = data.draw(st.integers(0, k - 1))  # the sequence the advance refuses; those before it moved and go back
    how = data.draw(st.sampled_from(["fed0", "fed2", "no token", "budget", "gone", "capacity"]))
    if how == "fed0":
        fed[bad] = 0
    elif how == "fed2":
        fed[bad] = 2
    elif how == "no token":
        tokens[bad] = -1
    elif how == "budget":
        state.seqs[bad].max_new = 1  # one token generated already: a second is past the budget
    elif how == "capacity":
        state.seqs[bad].qsa.capacity = 5  # its keys are full: one more is past it
    planned = ev.StepPlanned(1, (), tuple(range(k)), tuple(fed), (), (), ())
    state.inflight, state.step = planned, 2  # planned as given, unchecked: the advance must catch what is wrong
    if how == "gone":
        del state.seqs[bad]
    reference = copy.deepcopy(state)
    expected = None
    try:  # the two-pass path alone: what it refuses, and with what
        steps._advance_two_pass(reference, planned, tuple(tokens), CAPS.block_size)
    except TransitionRefused as exc:
        expected = exc.machine, exc.why, exc.fields
    before = _fields(state)
    got = _refusal(state, tuple(tokens))
    assert got is not None and got == expected
    assert _fields(state) == before


def test_the_pass_undoes_the_sequences_before_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    undone: list[int] = []
    real = advance._undo
    monkeypatch.setattr(advance, "_undo", lambda state, plan, tokens, k: (undone.append(k), real(state, plan, tokens, k)))
    state = _running(18)
    state.inflight, state.step = ev.StepPlanned(1, (), tuple(range(18)), (1,) * 17 + (0,), (), (), ()), 2
    before = _fields(state)
    assert _refusal(state, (8,) * 18) == ("SequenceCursor", "fed tokens beyond the known tokens",
                                           {"seq_id": 17, "computed": 5, "fed": 0, "seq_len": 6})
    assert undone == [17] and _fields(state) == before


@pytest.mark.parametrize("k", [3, 18])
def test_a_commit_is_the_two_pass_commit(k: int) -> None:
    one, two = _running(k), _running(k)
    for state in (one, two):
        state.apply(ev.StepPlanned(1, (), tuple(range(k)), (1,) * k, (), (), ()))
    one.apply(ev.StepExecuted(1, tuple(range(10, 10 + k))))
    plan = two.inflight
    assert plan is not None
    suspects = steps._advance_two_pass(two, plan, tuple(range(10, 10 + k)), CAPS.block_size)
    assert suspects == []
    assert _fields(one)[0] == _fields(two)[0] and _fields(one)[2] == _fields(two)[2]
    assert one.digest() != _running(k).digest()  # it moved
