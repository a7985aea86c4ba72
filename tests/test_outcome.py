"""The step's pure parts without a model: `schedule` and `plan_step` read a ControlState, `outcome` folds a
hand-made StepResult into events, `cursor_violation` checks what the data plane reports."""

from __future__ import annotations

import pytest

from atlas.config import EngineConfig, derive_capacities
from atlas.engine.drafters import ScriptedDrafter
from atlas.engine.drafters.lane import SpeculativeLane
from atlas.engine.outcome import cursor_violation, outcome
from atlas.engine.planner import Lanes, plan_step, schedule
from atlas.errors import InvariantViolation
from atlas.plan import BackendCursors, RowVerdict, SeqOutcome, StepResult
from atlas.sampling.params import SamplingParams
from atlas.state.control import ControlState
from atlas.state.events import RequestArrived, StepExecuted, StepPlanned

# prefill_align 0: the budget-cut chunks these steps are written for (derived, it would be 4: 8 - one verify of 3)
CONFIG = EngineConfig(max_seq_len=32, max_batch_size=2, prefill_chunk_tokens=8, block_size=4, num_drafts=2,
                      drafter="scripted", prefill_align=0)
CAPS = derive_capacities(CONFIG, None)


def state_with(*prompts: list[int]) -> ControlState:
    state = ControlState.create(CAPS)
    for i, prompt in enumerate(prompts):
        state.apply(RequestArrived(f"r{i}", i, prompt, SamplingParams(max_tokens=8).to_json(), 8, False))
    return state


def step(state: ControlState, lanes: Lanes) -> None:
    for e in schedule(state, lanes):
        state.apply(e)


def cursors(n: int, drafter: int = 0) -> BackendCursors:
    return BackendCursors(n, n, n, n, drafter)


def test_schedule_and_plan_are_read_off_the_state() -> None:
    state = state_with([1, 2, 3, 4, 5], [6, 7])
    lanes = Lanes()
    step(state, lanes)
    planned = state.inflight
    assert isinstance(planned, StepPlanned) and planned.seqs == (0, 1) and planned.fed == (5, 2)
    plan = plan_step(state, lanes)
    assert [(w.seq_id, w.tokens, w.start, w.sample) for w in plan.work] == [(0, (1, 2, 3, 4, 5), 0, True),
                                                                            (1, (6, 7), 0, True)]
    assert plan.work[0].block_table == tuple(state.seqs[0].blocks) and len(plan.work[0].block_table) == 2
    assert not plan.restores and not plan.prefix_stores and plan.carry.store == -1


def test_outcome_folds_a_result_into_step_executed_and_checks_cursors() -> None:
    state = state_with([1, 2, 3])
    lanes = Lanes()
    step(state, lanes)
    plan = plan_step(state, lanes)
    result = StepResult(plan.step, (SeqOutcome(0, cursors(3), token=9),))
    folded = outcome(state, plan, result, vocab_size=16, index=5)
    (executed,) = folded.events
    assert isinstance(executed, StepExecuted) and executed.tokens == (9,) and not folded.refused
    state.apply(executed)
    assert state.seqs[0].cursor.tokens == [1, 2, 3, 9] and state.seqs[0].cursor.computed == 3
    assert cursor_violation(state, plan, result, 5) is None
    torn = StepResult(plan.step, (SeqOutcome(0, BackendCursors(3, 2, 3, 3, 0), token=9),))
    v = cursor_violation(state, plan, torn, 5)
    assert v is not None and v.machine == "BackendCursors" and v.fields["backend"]["qsa_ingested"] == 2


@pytest.mark.parametrize("result_of", [
    lambda step: StepResult(step, ()),  # an outcome missing
    lambda step: StepResult(step, (SeqOutcome(0, cursors(3)),)),  # no token where one was sampled
    lambda step: StepResult(step, (SeqOutcome(0, cursors(3), token=99),)),  # outside the vocabulary
])
def test_a_result_that_cannot_be_the_plans_is_a_violation(result_of) -> None:
    state = state_with([1, 2, 3])
    lanes = Lanes()
    step(state, lanes)
    plan = plan_step(state, lanes)
    with pytest.raises(InvariantViolation, match="Backend"):
        outcome(state, plan, result_of(plan.step), vocab_size=16, index=0)


def verify_state() -> tuple[ControlState, Lanes]:
    """A decoding sequence whose next step verifies the drafts (4, 5)."""
    state = state_with([1, 2, 3])
    lanes = Lanes(spec=SpeculativeLane(ScriptedDrafter(lambda r: [4, 5]), CAPS, 2, 16, per_row_qsa=True))
    step(state, lanes)
    plan = plan_step(state, lanes)
    (e,) = outcome(state, plan, StepResult(plan.step, (SeqOutcome(0, cursors(3), token=7),)), 16, 0).events
    state.apply(e)
    step(state, lanes)
    return state, lanes


def test_a_verify_commits_what_its_verdicts_accept() -> None:
    state, lanes = verify_state()
    plan = plan_step(state, lanes)
    (w,) = plan.work
    assert w.drafts == (4, 5) and w.tokens == (7,)
    verdicts = (RowVerdict(True, 4), RowVerdict(False, 8), RowVerdict(False, 1))
    good = StepResult(plan.step, (SeqOutcome(0, cursors(5), token=8, verdicts=verdicts, accepted=1),))
    (e,) = outcome(state, plan, good, 16, 0).events
    assert (e.tokens, e.accepted, e.verdicts) == ((8,), (1,), (0b01,))
    state.apply(e)
    assert state.seqs[0].cursor.tokens == [1, 2, 3, 7, 4, 8] and state.seqs[0].cursor.computed == 5
    assert cursor_violation(state, plan, good, 0) is None


def test_a_commit_the_verdicts_do_not_support_is_a_violation_and_a_refusal_an_error() -> None:
    state, lanes = verify_state()
    plan = plan_step(state, lanes)
    verdicts = (RowVerdict(True, 4), RowVerdict(False, 8), RowVerdict(False, 1))
    wrong = StepResult(plan.step, (SeqOutcome(0, cursors(6), token=1, verdicts=verdicts, accepted=2),))
    with pytest.raises(InvariantViolation, match="accepted chain"):
        outcome(state, plan, wrong, 16, 0)
    refused = StepResult(plan.step, (SeqOutcome(0, cursors(4), verdicts=verdicts, accepted=-1, refused="pool"),))
    folded = outcome(state, plan, refused, 16, 0)
    assert folded.refused == {0: "verify commit refused: pool"}
    (e,) = folded.events
    state.apply(e)
    assert 0 in state.failing and state.seqs[0].cursor.computed == 3
    assert len(state.seqs[0].blocks) == 1  # the block the drafts took is free again
