"""The engine's batch columns (atlas.state.batch_columns, on in every Engine's state): the same plans, events, digests
and outputs as the objects alone, on null-engine runs whose decode steps go through them (streams and held-back
requests, stop tokens, stop strings, min_tokens, logprobs, budgets ending mid-batch, arrivals, a cancel, preemption);
the same refusal or violation (machine, message, fields) for a damaged step event and a wrong reported cursor; and
every field the columns hold equal to the objects' after every event."""

from __future__ import annotations

import attrs
import pytest
from fixtures import null_workload

from atlas.config import EngineConfig
from atlas.engine.outcome import cursor_violation
from atlas.engine.records import RecordingSink
from atlas.plan import BackendCursors, SeqOutcome, StepPlan, StepResult
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.control import ControlState, sequence_fingerprint
from atlas.state.events import Event, StepExecuted, StepPlanned
from atlas.state.invariants import audit

REQUESTS = 26  # more than steps.VECTOR_MIN running at once


def _params(i: int) -> SamplingParams:
    kind = i % 6
    if kind == 1:
        return SamplingParams(max_tokens=9 + i % 7, temperature=0.8, seed=i, stop_token_ids=[3, 70, 111])
    if kind == 2:
        return SamplingParams(max_tokens=14, temperature=0.7, seed=i, stop=["a", "ZZ"])
    if kind == 3:
        return SamplingParams(max_tokens=16, temperature=0.9, seed=i, min_tokens=4, stop_token_ids=[5, 9])
    if kind == 4:
        return SamplingParams(max_tokens=11, temperature=0.6, seed=i, logprobs=2, ignore_eos=True)
    return SamplingParams(max_tokens=12 + i % 9, temperature=0.7, seed=i, ignore_eos=kind == 0)


def _run(on: bool, *, blocks: int | None = None) -> tuple[list, list, list, ControlState, list[int]]:
    """(sink rows, outputs per step, plans, the final state, steps whose StepExecuted went through the columns)."""
    config = EngineConfig(max_seq_len=96, max_batch_size=24, prefill_chunk_tokens=160, block_size=8,
                          num_kv_blocks=blocks)
    sink = RecordingSink()
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=sink)
    engine.state.batch_cache = on
    plans = []
    execute = engine.backend.execute

    def recorded(plan):  # type: ignore[no-untyped-def]
        plans.append(plan)
        return execute(plan)

    engine.backend.execute = recorded  # type: ignore[method-assign]
    engine.backend.retains_plans = True  # type: ignore[attr-defined]  # `plans` keeps them (atlas.plan: who owns a plan)
    quiet = engine.book._settle_quiet
    settled: list[int] = []

    def counted(cols):  # type: ignore[no-untyped-def]
        rest = quiet(cols)
        settled.append(len(cols.ids) - len(cols.ids if rest is None else rest))
        return rest

    engine.book._settle_quiet = counted  # type: ignore[method-assign]
    used: list[int] = []
    outputs = []
    for i in range(REQUESTS - 4):
        engine.add_request(f"r{i}", [(i * 7 + k) % 200 + 1 for k in range(5 + (i * 5) % 19)], _params(i),
                           stream=i % 4 == 1)
    step = 0
    while engine.has_unfinished():
        if step == 6:  # arrivals while the batch decodes
            for i in range(REQUESTS - 4, REQUESTS):
                engine.add_request(f"r{i}", [i + 1] * (3 + i % 5), _params(i), stream=i % 2 == 0)
        if step == 9 and "r0" in engine.state.by_request:
            engine.cancel("r0")
        cols = engine.state.batch
        outputs.append(engine.step())
        if cols is not None and engine.state.batch is cols:
            used.append(step)
        if on:
            _check_columns(engine.state)
        step += 1
    state = engine.state
    engine.close()
    assert not on or sum(settled) >= 20  # held-back rows settled by the columns' quiet path
    return sink.rows, outputs, plans, state, used


def _check_columns(state: ControlState) -> None:
    """Every field the batch columns hold is the objects' (the write-through's contract)."""
    cols = state.batch
    if cols is None:
        return
    assert list(cols.ids) == state.running
    seqs = [state.seqs[s] for s in cols.ids]
    assert cols.objs == seqs
    assert cols.ends == [s.cursor.computed for s in seqs] == cols.computed.tolist()
    assert cols.ntok.tolist() == [len(s.cursor.tokens) for s in seqs]
    assert cols.token_hash.tolist() == [s.cursor.token_hash for s in seqs]
    assert cols.fp.tolist() == [s.fingerprint for s in seqs] == [sequence_fingerprint(s) for s in seqs]
    assert cols.nblocks.tolist() == [len(s.blocks) for s in seqs]
    assert cols.tables == [tuple(s.blocks) for s in seqs]
    assert cols.limit.tolist() == [min(s.qsa.capacity, len(s.blocks) * cols.bs) for s in seqs]
    assert cols.low.tolist() == [(len(s.blocks) - 1) * cols.bs for s in seqs]
    if cols.last is not None:
        assert cols.last == [s.cursor.tokens[-1] for s in seqs]
    if cols.next_decode:
        assert all(len(s.cursor.tokens) - s.cursor.computed == 1 for s in seqs)


@pytest.mark.parametrize(("blocks", "columns_steps"), [(None, 8), (60, 3)])  # 60 blocks of 8: KV runs out, preempts
def test_same_run_with_and_without_the_columns(blocks: int | None, columns_steps: int) -> None:
    rows_on, out_on, plans_on, state_on, used = _run(True, blocks=blocks)
    rows_off, out_off, plans_off, state_off, unused = _run(False, blocks=blocks)
    assert not unused
    assert len(used) >= columns_steps, used  # decode steps went through the columns
    assert [(i, s, e, d) for i, s, e, d in rows_on] == [(i, s, e, d) for i, s, e, d in rows_off]
    assert plans_on == plans_off
    assert out_on == out_off
    if blocks is not None:
        assert any(e.kind == "sequence_preempted" for _, _, e, _ in rows_on)
    assert state_on.digest() == state_off.digest()
    audit(state_on, 0)


# ---------------------------------------------------------------------------------- refusals and violations


@pytest.fixture(scope="module")
def recorded() -> tuple[object, list[Event]]:
    sink = RecordingSink()
    caps = null_workload.run(24, lambda i: 12 + i % 9, sink=sink)
    return caps, [e for _, _, e, _ in sink.rows]


def _apply_all(caps: object, events: list[Event], on: bool) -> tuple[list[str], tuple | None, int, set[int]]:
    """Every event with the invariants after each: the digests, the first failure, how many StepExecuted the
    columns took, and the indices of the events applied with columns."""
    state = ControlState.create(caps)  # type: ignore[arg-type]
    state.batch_cache = on
    digests = []
    taken = 0
    with_columns: set[int] = set()
    for index, e in enumerate(events):
        cols = state.batch
        if cols is not None:
            with_columns.add(index)
        failure = null_workload.apply_checked(state, e, index)
        if failure is not None:
            return digests, failure, taken, with_columns
        if isinstance(e, StepExecuted) and cols is not None and state.batch is cols:
            taken += 1
        if on:
            _check_columns(state)
        digests.append(state.digest())
    return digests, None, taken, with_columns


def _mid_decode(events: list[Event], kind: type) -> int:
    """The index of a StepPlanned / StepExecuted well inside the run's decode steps."""
    steps = [i for i, e in enumerate(events) if isinstance(e, kind) and len(e.seqs if kind is StepPlanned
                                                                                else e.tokens) >= 18]
    return steps[len(steps) // 2]


def test_recorded_events_through_the_columns(recorded: tuple[object, list[Event]]) -> None:
    caps, events = recorded
    on, failure_on, taken, _ = _apply_all(caps, events, True)
    off, failure_off, _, _ = _apply_all(caps, events, False)
    assert failure_on is failure_off is None
    assert on == off
    assert taken >= 10


def _damaged(events: list[Event], index: int, **changes: object) -> list[Event]:
    return [*events[:index], attrs.evolve(events[index], **changes), *events[index + 1:]]


@pytest.mark.parametrize("damage", ["fed_past_tokens", "zero_fed", "missing_token", "token_outside_vocabulary",
                                    "blocks_past_tokens"])
def test_damaged_step_is_reported_as_without_columns(recorded: tuple[object, list[Event]], damage: str) -> None:
    caps, events = recorded
    if damage in ("fed_past_tokens", "zero_fed", "blocks_past_tokens"):
        i = _mid_decode(events, StepPlanned)
        e = events[i]
        fed = list(e.fed)
        if damage == "fed_past_tokens":
            fed[7] = 3
            bad = _damaged(events, i, fed=tuple(fed))
        elif damage == "zero_fed":
            fed[11] = 0
            bad = _damaged(events, i, fed=tuple(fed))
        else:  # two more blocks for one row than its tokens reach
            free = sorted(set(range(caps.num_kv_blocks)) - {b for row in e.alloc for b in row[1:]})  # type: ignore
            bad = _damaged(events, i, alloc=(*e.alloc, (e.seqs[5], free[-1], free[-2])))
    else:
        i = _mid_decode(events, StepExecuted)
        tokens = list(events[i].tokens)
        if damage == "missing_token":
            tokens[9] = -1
        else:  # the state machines do not check the vocabulary (outcome does): it applies, same digests
            tokens[3] = 10**6
        bad = _damaged(events, i, tokens=tuple(tokens))
    digests_on, failure_on, _, with_columns = _apply_all(caps, bad, True)
    digests_off, failure_off, _, _ = _apply_all(caps, bad, False)
    assert i in with_columns  # the damaged event met the columns
    assert failure_off is not None or damage == "token_outside_vocabulary"
    assert failure_on == failure_off
    assert digests_on == digests_off


def _replayed(caps: object, events: list[Event], upto: int, columns: bool) -> ControlState:
    """A state with events[:upto] applied, the batch columns on or off."""
    state = ControlState.create(caps)  # type: ignore[arg-type]
    state.batch_cache = columns
    for e in events[:upto]:
        state.apply(e)
    return state


def test_wrong_reported_cursor_named_as_without_columns(recorded: tuple[object, list[Event]]) -> None:
    caps, events = recorded
    i = _mid_decode(events, StepExecuted)
    results = []
    for on in (True, False):
        state = _replayed(caps, events, i, on)
        plan_event = state.inflight
        assert plan_event is not None
        state.apply(events[i])
        assert (state.batch is not None) == on
        plan = StepPlan(plan_event.step, ())
        outs, clean = [], []
        for k, seq_id in enumerate(plan_event.seqs):
            n = state.seqs[seq_id].cursor.computed
            outs.append(SeqOutcome(seq_id, BackendCursors(n, n, n - (k == 13), n, 0), 1))  # row 13's state behind
            clean.append(SeqOutcome(seq_id, BackendCursors(n, n, n, n, 0), 1))
        assert cursor_violation(state, plan, StepResult(plan.step, tuple(clean)), 7) is None
        v = cursor_violation(state, plan, StepResult(plan.step, tuple(outs)), 7)
        assert v is not None
        assert v.fields["seq_id"] == plan_event.seqs[13]
        results.append((v.event_index, v.machine, v.message, v.fields))
    assert results[0] == results[1]
    assert results[0][3]["seq_id"] == events[i - 1].seqs[13] if isinstance(events[i - 1], StepPlanned) else True


@pytest.mark.parametrize("bad", ["stamp_behind", "none"])
def test_shared_stamped_cursors_checked_as_without_columns(recorded: tuple[object, list[Event]], bad: str) -> None:
    """The CUDA reader's form: one BackendCursors with stamps per position, its uniform() computed, shared by every
    row at that position; one row's own cursor with a GDN stamp one behind (or none)."""
    caps, events = recorded
    i = _mid_decode(events, StepExecuted)
    results = []
    for on in (True, False):
        state = _replayed(caps, events, i + 1, on)
        assert (state.batch is not None) == on
        plan_event = events[i - 1] if isinstance(events[i - 1], StepPlanned) else None
        ids = tuple(state.running)
        shared: dict[int, BackendCursors] = {}
        outs = []
        for k, seq_id in enumerate(ids):
            n = state.seqs[seq_id].cursor.computed
            if k == 13 and bad == "stamp_behind":
                cur = BackendCursors(n, n, n, n, 0, (("kv", 0, n), ("gdn", 1, n - 1), ("qsa", 2, n)))
            else:
                cur = shared.get(n) or shared.setdefault(n, BackendCursors(n, n, n, n, 0, (
                    ("kv", 0, n), ("gdn", 1, n), ("qsa", 2, n))))
            cur.uniform()
            outs.append(SeqOutcome(seq_id, cur, 1))
        v = cursor_violation(state, StepPlan(state.step - 1, ()), StepResult(state.step - 1, tuple(outs)), 7)
        results.append(None if v is None else (v.machine, v.message, v.fields))
    assert plan_event is None or plan_event.seqs == ids
    assert results[0] == results[1]
    assert (results[0] is None) == (bad == "none")
