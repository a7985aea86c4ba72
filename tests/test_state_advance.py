"""StepExecuted's advance of a step without drafts: a refusal found at any sequence leaves every sequence as it was
and names that sequence. Batches of 16+ sequences, so the column fingerprints are on too."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atlas.config import EngineConfig, derive_capacities
from atlas.errors import TransitionRefused
from atlas.sampling.params import SamplingParams
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
    before = _fields(state)
    got = _refusal(state, tuple(tokens))
    assert got is not None and got[2]["seq_id"] == bad
    assert got[0] == {"fed0": "SequenceCursor", "fed2": "SequenceCursor", "no token": "SequenceCursor",
                      "budget": "Request", "gone": "Request", "capacity": "QsaCursor"}[how]
    assert _fields(state) == before
