"""The settle lag's and the block allocation's shortcuts: each must leave the engine
exactly where its slow form leaves it. settle's lag (RequestBook._settle_quiet / _flush_lag) keeps a decode step's
tokens instead of writing every quiet row's checker and held tokens: runs with it on and off give the same outputs
every step, the same events and digests, and, once flushed, the same checkers and held tokens. An allocation of one
block to every row (BatchColumns._allocate_every_row, plan_hash's column rows, _check_plan's set form, decode_work
reusing SeqWork without writing unchanged block tables) gives the same events, digests, plans and columns as the
general forms, and a bad alloc row the same refusal."""

from __future__ import annotations

from functools import reduce
from operator import xor

import attrs
import pytest
from fixtures import null_workload

from atlas.config import EngineConfig
from atlas.engine.records import RecordingSink
from atlas.errors import InvariantViolation, TransitionRefused
from atlas.hashing import ints_key
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state import batch_alloc, batch_columns, steps
from atlas.state.control import ControlState, sequence_fingerprint
from atlas.state.events import StepPlanned
from atlas.state.invariants import check_invariants

REQUESTS = 30


def _params(i: int) -> SamplingParams:
    kind = i % 6
    if kind == 1 and i < 12:  # stop ids: a token in the quiet rows' union sends the step to the loop
        return SamplingParams(max_tokens=50, temperature=0.9, seed=i, stop_token_ids=[70, 111], ignore_eos=True)
    if kind == 2:  # budgets ending one by one, mid-batch
        return SamplingParams(max_tokens=30 + 2 * i, temperature=0.7, seed=i, ignore_eos=True)
    if kind == 3:  # not quiet (logprobs): the rows the quiet path leaves
        return SamplingParams(max_tokens=40, temperature=0.6, seed=i, logprobs=1, ignore_eos=True)
    return SamplingParams(max_tokens=44 + i % 7, temperature=0.8, seed=i, min_tokens=2 if kind == 4 else 0,
                          ignore_eos=kind != 5)


def _book_state(engine) -> dict:  # type: ignore[no-untyped-def]
    book = engine.book
    if book._lag:
        book._flush_lag()
    stops = {s: (c.count, list(c.later), c.text, list(c.unread), c.emitted, c.cut) for s, c in book.stops.items()}
    held = {s: (list(h.tokens), list(h.logprobs), list(h.top)) for s, h in book.held.items()}
    return {"stops": stops, "held": held, "counts": attrs.asdict(book.counts)}


def _run(lag: bool, *, cancel_at: int = 11, compare_every: int = 9) -> tuple[list, list, list, int]:
    config = EngineConfig(max_seq_len=128, max_batch_size=24, prefill_chunk_tokens=200, block_size=8)
    sink = RecordingSink()
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=sink)
    engine.book.lag = lag
    for i in range(REQUESTS - 6):
        engine.add_request(f"r{i}", [(i * 5 + k) % 190 + 2 for k in range(4 + (i * 3) % 17)], _params(i),
                           stream=i % 7 == 6)
    outputs, books = [], []
    longest = 0
    step = 0
    while engine.has_unfinished():
        if step == 14:  # arrivals while the batch decodes: the batch's rows change
            for i in range(REQUESTS - 6, REQUESTS):
                engine.add_request(f"r{i}", [i + 3] * (3 + i % 4), _params(i))
        if step == cancel_at and "r4" in engine.state.by_request:
            engine.cancel("r4")  # a cancel between steps flushes the lag first
        outputs.append(engine.step())
        longest = max(longest, len(engine.book._lag))
        if step % compare_every == compare_every - 1:
            books.append(_book_state(engine))
        step += 1
    books.append(_book_state(engine))
    engine.close()
    return outputs, [(i, s, e, d) for i, s, e, d in sink.rows], books, longest


def test_lag_gives_the_same_outputs_events_and_book() -> None:
    out_on, rows_on, books_on, longest = _run(True)
    out_off, rows_off, books_off, none = _run(False)
    assert none == 0
    assert longest >= 5  # steps were lagged (the comparison above is of something)
    assert out_on == out_off
    assert rows_on == rows_off
    assert books_on == books_off


def test_lag_flushed_every_step_is_the_loop() -> None:
    """Flushed after every step (at most one lagged step), and never compared mid-run: the same as off."""
    out_on, rows_on, books_on, _ = _run(True, compare_every=1)
    out_off, rows_off, books_off, _ = _run(False, compare_every=1)
    assert (out_on, rows_on, books_on) == (out_off, rows_off, books_off)


# ------------------------------------------------------------------ every row allocating in one step (one prompt length)

def _uniform_run(fast: bool, columns: bool, monkeypatch, check=None) -> tuple[list, list, list, dict]:  # type: ignore[no-untyped-def]
    """20 rows of one prompt length, blocks of 8: every 8th step every row takes a block in the same StepPlanned (the
    control-plane benchmark's pattern). `fast` off: the set form of _check_plan, BatchColumns' every-row allocation
    and plan_hash's column rows all stand aside (their pair test never passes), the general forms run instead."""
    if not fast:
        monkeypatch.setattr(steps, "_PAIR", frozenset())
        monkeypatch.setattr(batch_alloc, "_PAIR", frozenset())
    taken = {"every_row": 0, "reused_without_tables": 0}
    every = batch_columns.BatchColumns._allocate_every_row

    def counted(self, pool, new):  # type: ignore[no-untyped-def]
        taken["every_row"] += 1
        return every(self, pool, new)

    monkeypatch.setattr(batch_columns.BatchColumns, "_allocate_every_row", counted)
    config = EngineConfig(max_seq_len=80, max_batch_size=20, prefill_chunk_tokens=400, block_size=8)
    sink = RecordingSink()
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=sink)
    engine.state.batch_cache = columns
    plans = []  # what each plan's work says, copied (holding the plan would keep decode_work from reusing its SeqWork)
    execute = engine.backend.execute

    def recorded(plan):  # type: ignore[no-untyped-def]
        cols = engine.state.batch
        if cols is not None and plan.work is cols.work and not cols.tables_moved:
            taken["reused_without_tables"] += 1
        plans.append([(w.seq_id, w.tokens, w.start, w.block_table, w.sample) for w in plan.work])
        return execute(plan)

    engine.backend.execute = recorded  # type: ignore[method-assign]
    for i in range(20):
        engine.add_request(f"r{i}", [(i * 7 + k) % 150 + 1 for k in range(6)],
                           SamplingParams(max_tokens=40 + i % 3, temperature=0.7, seed=i, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        if check is not None:
            check(engine.state)
    engine.close()
    return [(i, s, e, d) for i, s, e, d in sink.rows], outputs, plans, taken


def _columns_hold(state: ControlState) -> None:
    cols = state.batch
    if cols is None:
        return
    seqs = [state.seqs[s] for s in cols.ids]
    assert cols.tables == [tuple(s.blocks) for s in seqs]
    assert cols.nblocks.tolist() == [len(s.blocks) for s in seqs]
    assert cols.limit.tolist() == [min(s.qsa.capacity, len(s.blocks) * cols.bs) for s in seqs]
    assert cols.low.tolist() == [(len(s.blocks) - 1) * cols.bs for s in seqs]
    assert cols.hi.tolist() == [min(min(s.qsa.capacity, len(s.blocks) * cols.bs), s.cursor.prompt_len + s.max_new - 1)
                                for s in seqs]
    assert cols.fp.tolist() == [s.fingerprint for s in seqs] == [sequence_fingerprint(s) for s in seqs]
    assert state.seq_digest == reduce(xor, (s.fingerprint for s in state.seqs.values()), 0)


def test_every_row_allocation_equals_the_general_forms(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with monkeypatch.context() as m:
        rows_fast, out_fast, plans_fast, taken = _uniform_run(True, True, m, _columns_hold)
    with monkeypatch.context() as m:
        rows_slow, out_slow, plans_slow, slow = _uniform_run(False, True, m, _columns_hold)
    with monkeypatch.context() as m:
        rows_off, out_off, plans_off, _ = _uniform_run(True, False, m)
    assert taken["every_row"] >= 3 and slow["every_row"] == 0  # whole-batch allocations through the fast form
    assert taken["reused_without_tables"] >= 10  # decode_work's SeqWork reused without their block tables written
    assert rows_fast == rows_slow == rows_off  # same events, payloads and digests (the plan's hash is in the digest)
    assert out_fast == out_slow == out_off
    assert plans_fast == plans_slow == plans_off  # every SeqWork's tokens, start and block table


def test_plan_hash_is_ints_key_on_allocation_steps(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    seen = []
    real = batch_columns.BatchColumns.plan_hash

    def checked(self, e):  # type: ignore[no-untyped-def]
        key = real(self, e)
        assert key == ints_key(b"atlas.plan", (e.seqs, e.fed, *e.alloc, e.release, e.reset, e.restored, *e.drafts))
        seen.append(len(e.alloc))
        return key

    monkeypatch.setattr(batch_columns.BatchColumns, "plan_hash", checked)
    _uniform_run(True, True, monkeypatch)
    assert max(seen) == 20 and 0 in seen


@pytest.mark.parametrize("damage", ["not_free", "twice", "out_of_range", "negative", "not_live"])
def test_a_bad_alloc_row_is_refused_as_by_the_loop(damage: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """_check_plan's set form of the alloc rows' conditions: a plan of (seq_id, block) rows breaking one of them is
    refused exactly as the per-row loop refuses it (same machine, message and fields)."""
    sink = RecordingSink()
    caps = null_workload.run(20, lambda i: 12 + i % 5, sink=sink)
    events = [e for _, _, e, _ in sink.rows]
    at = next(i for i, e in enumerate(events) if isinstance(e, StepPlanned) and len(e.alloc) >= 4
              and all(len(row) == 2 for row in e.alloc))
    e = events[at]
    alloc = [list(row) for row in e.alloc]
    used = {b for row in e.alloc for b in row[1:]}
    if damage == "not_free":  # a block some earlier row of the run holds
        held = next(b for ev in events[:at] if isinstance(ev, StepPlanned) for row in ev.alloc for b in row[1:])
        alloc[2][1] = held
    elif damage == "twice":
        alloc[3][1] = alloc[1][1]
    elif damage == "out_of_range":
        alloc[2][1] = caps.num_kv_blocks
    elif damage == "negative":
        alloc[1][1] = -1
    else:  # a finished sequence's id
        alloc[2][0] = 10_000
    assert used
    bad = [*events[:at], attrs.evolve(e, alloc=tuple(map(tuple, alloc)))]

    def refusal(fast: bool) -> tuple:
        with monkeypatch.context() as m:
            if not fast:
                m.setattr(steps, "_PAIR", frozenset())
            state = ControlState.create(caps)
            for index, ev in enumerate(bad):
                try:
                    check_invariants(state, state.apply(ev), index)
                except TransitionRefused as exc:
                    return index, exc.machine, exc.why, exc.fields
        return ()

    fast, slow = refusal(True), refusal(False)
    assert fast == slow and fast and fast[0] == at


# --------------------------------------------------------------- outcome's one walk over a decode's outcomes and cursors

def _swap(result, row):  # type: ignore[no-untyped-def]
    outs = list(result.outcomes)
    outs[row], outs[row + 1] = outs[row + 1], outs[row]
    return attrs.evolve(result, outcomes=tuple(outs))


def _one(result, row, **changes):  # type: ignore[no-untyped-def]
    outs = list(result.outcomes)
    outs[row] = attrs.evolve(outs[row], **changes)
    return attrs.evolve(result, outcomes=tuple(outs))


def _cursor(result, row, **changes):  # type: ignore[no-untyped-def]
    return _one(result, row, cursors=attrs.evolve(result.outcomes[row].cursors, **changes))


def _honest_stamps(result, row):  # type: ignore[no-untyped-def]
    c = result.outcomes[row].cursors
    return _cursor(result, row, stamps=(("kv", 0, c.kv_tokens), ("gdn", 1, c.ssm_position)))


def _uniform_stamps(result, row, off=0, kind="kv"):  # type: ignore[no-untyped-def]
    """Every row's cursors with stamps, memoised uniform as the CUDA reader marks its shared ones; `off`: row's kv
    stamp that far from its position (its memo then says no uniform position, or the wrong one)."""
    outs = []
    for i, o in enumerate(result.outcomes):
        c = o.cursors
        n = c.kv_tokens
        at = {k: n + (off if i == row and k == kind else 0) for k in ("kv", "gdn", "qsa")}
        drafter = (("drafter", -1, off),) if i == row and kind == "drafter" else ()
        cur = attrs.evolve(c, stamps=(("kv", 0, at["kv"]), ("gdn", 1, at["gdn"]), ("qsa", 2, at["qsa"]), *drafter))
        cur.uniform()
        outs.append(attrs.evolve(o, cursors=cur))
    return attrs.evolve(result, outcomes=tuple(outs))


DAMAGE = {
    "uniform_stamps": _uniform_stamps,
    "uniform_stamps_off": lambda r, row: _uniform_stamps(r, row, 1),
    "uniform_qsa_off": lambda r, row: _uniform_stamps(r, row, -1, "qsa"),
    "uniform_drafter_off": lambda r, row: _uniform_stamps(r, row, 1, "drafter"),
    "uniform_stamps_all_off": lambda r, row: _uniform_stamps(_cursor(r, row, kv_tokens=r.outcomes[row].cursors.kv_tokens
                                                                     + 1, ssm_position=r.outcomes[row].cursors
                                                                     .ssm_position + 1), row + 50),
    "swapped_rows": _swap,  # out of the rows' order: align puts them back, the step goes on
    "refused": lambda r, row: _one(r, row, refused="backend said no"),
    "prompt_logprobs": lambda r, row: _one(r, row, prompt_logprobs=((3, -0.5, ()),)),
    "honest_stamps": _honest_stamps,
    "stamp_off": lambda r, row: _cursor(r, row, stamps=(("kv", 0, r.outcomes[row].cursors.kv_tokens + 1),)),
    "no_token": lambda r, row: _one(r, row, token=None),
    "drafter_rows": lambda r, row: _cursor(r, row, drafter_rows=1),
    "seq_id": lambda r, row: _one(r, row, seq_id=r.outcomes[row].seq_id + 1000),
}


class _Damaged:
    def __init__(self, backend, damage, step, row):  # type: ignore[no-untyped-def]
        self.backend, self.damage, self.step, self.row = backend, damage, step, row
        self.name, self.capabilities = backend.name, backend.capabilities

    def execute(self, plan):  # type: ignore[no-untyped-def]
        result = self.backend.execute(plan)
        return DAMAGE[self.damage](result, self.row) if self.step in (None, plan.step) else result

    def __getattr__(self, name):  # type: ignore[no-untyped-def]
        return getattr(self.backend, name)


def _damaged_run(damage: str | None, columns: bool, step: int | None = 7) -> tuple:
    config = EngineConfig(max_seq_len=64, max_batch_size=20, prefill_chunk_tokens=400, block_size=8)
    sink = RecordingSink()
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=sink)
    engine.state.batch_cache = columns
    walked = 0
    if damage is not None:
        engine.backend = _Damaged(engine.backend, damage, step, 5)  # type: ignore[assignment]
    for i in range(18):
        engine.add_request(f"r{i}", [(i * 3 + k) % 150 + 1 for k in range(7)],
                           SamplingParams(max_tokens=20 + i % 4, temperature=0.7, seed=i, ignore_eos=True),
                           stream=i % 5 == 2)
    outputs = []
    failure = None
    try:
        while engine.has_unfinished():
            outputs += engine.step()
            cols = engine.state.batch
            walked += cols is not None and cols.cursor_target is not None
    except InvariantViolation as v:
        failure = (v.machine, v.message, v.fields, v.event_index)
    return [(i, s, e, d) for i, s, e, d in sink.rows], outputs, failure, walked


@pytest.mark.parametrize("damage", [None, *DAMAGE])
def test_a_damaged_decode_result_goes_as_without_columns(damage: str | None) -> None:
    on = _damaged_run(damage, True)
    off = _damaged_run(damage, False)
    assert on[:3] == off[:3]  # same events, digests, outputs, and the same violation if any
    assert on[3] >= 5 and off[3] == 0  # decode steps went through the walk
    if damage in ("stamp_off", "no_token", "drafter_rows", "seq_id", "uniform_stamps_off", "uniform_stamps_all_off",
                  "uniform_qsa_off", "uniform_drafter_off"):
        assert on[2] is not None
    elif damage in ("refused", "prompt_logprobs", "swapped_rows", "honest_stamps", "uniform_stamps"):
        assert on[2] is None


def test_uniform_stamps_every_step_through_the_walk() -> None:
    """Every step's cursors with stamps memoised uniform (the CUDA reader's form): the walk takes them, as without
    columns; one row's kv stamp one off at every step is named at the first decode step as without columns."""
    on, off = _damaged_run("uniform_stamps", True, None), _damaged_run("uniform_stamps", False, None)
    assert on[:3] == off[:3] and on[2] is None and on[3] >= 5
    on, off = _damaged_run("uniform_stamps_off", True, None), _damaged_run("uniform_stamps_off", False, None)
    assert on[:3] == off[:3] and on[2] is not None
