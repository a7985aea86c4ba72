"""The column hash's and the ends' shortcuts, each against its slow form, and two checks once named as weak
mutation spots (a mutation of them was not caught by any test):

- `mix64_column` (ufuncs with their output array, one temporary) equals atlas.hashing.mix64 on every element;
- `BatchColumns.ntok_values` (one `ntok.tolist()` for the outcome's walk and `advance`'s ends) equals the column
  after every event, and the engine's events, digests, outputs and plans are the columns-off run's;
- `exact_tokens` / StepExecuted's tokens converter: only the very tuple of exact ints it passed is taken as it is;
- `_check_plan`'s set form still refuses a block outside the pool when a corrupted free list holds it (its range
  test is what refuses it: the free-list test alone would not);
- `RequestBook.forget` (a cancel) writes the lagged steps into the row's checker and held tokens before dropping
  them: the checker counts exactly the tokens the sequence generated.
"""

from __future__ import annotations

import copy

import attrs
import numpy as np
import pytest
from fixtures import null_workload
from test_settle_lag_and_block_rows import _columns_hold, _params, _uniform_run

from atlas.config import EngineConfig, derive_capacities
from atlas.engine.records import RecordingSink
from atlas.errors import TransitionRefused
from atlas.hashing import mix64
from atlas.plan import RingRestore
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state import batch_columns
from atlas.state.columns import mix64_column
from atlas.state.control import ControlState
from atlas.state.events import RequestArrived as RequestArrivedEvent
from atlas.state.events import RequestFinished, StepExecuted, StepPlanned, exact_tokens
from atlas.state.invariants import audit, check_invariants


@pytest.mark.parametrize("n", [0, 1, 3, 64, 5000])
def test_mix64_column_is_mix64_on_every_element(n: int) -> None:
    rng = np.random.default_rng(n)
    x = rng.integers(0, 2**63, size=n, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, size=n, dtype=np.uint64)
    x[:min(n, 3)] = np.array([0, 2**64 - 1, 1 << 63], dtype=np.uint64)[:min(n, 3)]
    h = x.copy()
    out = mix64_column(h)
    assert out is h  # in place
    assert h.tolist() == [mix64(v) for v in x.tolist()]


def test_mix64_column_of_no_column_is_mix64() -> None:
    """A 0-d array (in place) and a numpy scalar (a new one) take the operators' form."""
    for v in (0, 12345, 2**64 - 1):
        h = np.array(v, dtype=np.uint64)
        assert int(mix64_column(h)) == mix64(v) == int(h)
        assert int(mix64_column(np.uint64(v))) == mix64(v)


def _ntok_holds(state: ControlState) -> None:
    _columns_hold(state)
    cols = state.batch
    if cols is None:
        return
    assert cols.ntok_values() == cols.ntok.tolist() == [len(s.cursor.tokens) for s in cols.objs]
    assert cols.ends == cols.computed.tolist() == [s.cursor.computed for s in cols.objs]


def test_one_ntok_list_gives_the_columns_off_run(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    shared = {"ends_is_the_walks": 0}
    advance = batch_columns.BatchColumns.advance

    def counted(self, tokens):  # type: ignore[no-untyped-def]
        memo = self.ntok_list
        walked = memo[1] if memo is not None and memo[0] is self.ntok else None
        change = advance(self, tokens)
        if change is not None and walked is not None and self.ends is walked:
            shared["ends_is_the_walks"] += 1
        return change

    with monkeypatch.context() as m:
        m.setattr(batch_columns.BatchColumns, "advance", counted)
        rows_on, out_on, plans_on, _ = _uniform_run(True, True, m, _ntok_holds)
    with monkeypatch.context() as m:
        rows_off, out_off, plans_off, _ = _uniform_run(True, False, m)
    assert shared["ends_is_the_walks"] >= 20  # the decode steps took the walk's list as their ends
    assert rows_on == rows_off  # same events, payloads and digests
    assert out_on == out_off
    assert plans_on == plans_off


def test_finishes_drop_the_walks_list() -> None:
    """`without` takes a row out of `ends` in place: the list the walk verdict and the memo hold goes with it."""
    config = EngineConfig(max_seq_len=128, max_batch_size=40, prefill_chunk_tokens=400, block_size=8)
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=RecordingSink())
    for i in range(40):
        engine.add_request(f"r{i}", [(i * 5 + k) % 190 + 2 for k in range(5)],
                           SamplingParams(max_tokens=12 + 2 * i, temperature=0.8, seed=i, ignore_eos=True))
    finishes = 0
    while engine.has_unfinished():
        before = engine.state.batch
        rows = None if before is None else len(before.ids)
        engine.step()
        cols = engine.state.batch
        if cols is not None and cols is before and rows != len(cols.ids):
            finishes += 1
            assert cols.cursor_target is None and cols.ntok_list is None
        _ntok_holds(engine.state)
    engine.close()
    assert finishes >= 10


def test_exact_tokens_and_the_converter() -> None:
    t = (65, 3, 0)
    assert exact_tokens(t)
    e = StepExecuted(4, t)
    assert e.tokens is t
    for bad in ([65, 3], (65, None), (65, True), (65, np.int64(3)), (65, 3.0)):
        assert not exact_tokens(bad)
    assert StepExecuted(4, t).tokens is t  # still the one remembered
    e = StepExecuted(4, (np.int64(7), 8))  # converted (another tuple than the one remembered)
    assert e.tokens == (7, 8) and all(type(x) is int for x in e.tokens)
    e = StepExecuted(4, [9, 10])
    assert e.tokens == (9, 10) and type(e.tokens) is tuple
    with pytest.raises(TypeError):
        StepExecuted(4, (1, None))
    assert exact_tokens(())


@pytest.mark.parametrize("where", ["negative", "past_the_pool"])
def test_a_block_outside_the_pool_in_a_corrupted_free_list_is_refused(where: str) -> None:
    sink = RecordingSink()
    caps = null_workload.run(20, lambda i: 12 + i % 5, sink=sink)
    events = [e for _, _, e, _ in sink.rows]
    at = next(i for i, e in enumerate(events) if isinstance(e, StepPlanned) and len(e.alloc) >= 4
              and all(len(row) == 2 for row in e.alloc))
    state = ControlState.create(caps)
    for index, ev in enumerate(events[:at]):
        check_invariants(state, state.apply(ev), index)
    bad_block = -1 if where == "negative" else state.pool.total
    state.pool.free[bad_block] = None  # the corruption: a block no pool has, on the free list
    alloc = [list(row) for row in events[at].alloc]
    alloc[1][1] = bad_block
    free, used = dict(state.pool.free), state.pool.used
    blocks = {s: list(seq.blocks) for s, seq in state.seqs.items()}
    with pytest.raises(TransitionRefused) as got:
        state.apply(attrs.evolve(events[at], alloc=tuple(map(tuple, alloc))))
    # refused by the plan's check, before anything moved (the pool's own test would refuse it after row 0's block)
    assert (got.value.machine, got.value.why) == ("BlockPool", "allocation of a block that is not free")
    assert got.value.fields == {"seq_id": alloc[1][0], "block": bad_block}
    assert state.pool.free == free and state.pool.used == used
    assert {s: list(seq.blocks) for s, seq in state.seqs.items()} == blocks


def test_a_cancel_writes_the_lag_into_the_rows_checker_first() -> None:
    config = EngineConfig(max_seq_len=128, max_batch_size=24, prefill_chunk_tokens=200, block_size=8)
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=RecordingSink())
    for i in range(18):
        engine.add_request(f"r{i}", [(i * 5 + k) % 190 + 2 for k in range(6)], _params(0))
    book = engine.book
    for _ in range(40):
        engine.step()
        if len(book._lag) >= 3:
            break
    assert len(book._lag) >= 3, "the workload lags"
    sid = min(book._quiet.lagged)  # type: ignore[union-attr]
    seq = engine.state.seqs[sid]
    stop, held = book.stops[sid], book.held[sid]
    generated = seq.cursor.generated
    held_before, lagged = len(held.tokens), len(book._lag)
    engine.cancel(seq.request_id)
    assert sid not in book.stops
    assert stop.count == generated  # every token it generated, the lagged steps' included
    assert len(held.tokens) == held_before + lagged
    assert list(held.tokens)[-lagged:] == list(seq.cursor.tokens[-lagged:])
    while engine.has_unfinished():
        engine.step()
    engine.close()


def _chunked_run(columns: bool, monkeypatch) -> tuple[list, list, int]:  # type: ignore[no-untyped-def]
    """Prompts longer than a step's token budget: the batch's rows go on prefilling in chunks (advances that are not a
    decode: some rows unsampled, `ends` from the computed column) before they decode."""
    taken = {"not_decode": 0}
    advance = batch_columns.BatchColumns.advance

    def counted(self, tokens):  # type: ignore[no-untyped-def]
        plain = not self.decode
        change = advance(self, tokens)
        if plain and change is not None:
            taken["not_decode"] += 1
        return change

    monkeypatch.setattr(batch_columns.BatchColumns, "advance", counted)
    config = EngineConfig(max_seq_len=260, max_batch_size=20, prefill_chunk_tokens=1000, block_size=8)
    sink = RecordingSink()
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=sink)
    engine.state.batch_cache = columns
    for i in range(20):
        engine.add_request(f"r{i}", [(i * 11 + k) % 180 + 1 for k in range(100 + i % 9)],
                           SamplingParams(max_tokens=20 + i % 5, temperature=0.7, seed=i, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        if columns:
            _ntok_holds(engine.state)
    engine.close()
    return [(i, s, e, d) for i, s, e, d in sink.rows], outputs, taken["not_decode"]


def test_chunked_advances_take_ends_from_the_computed_column(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with monkeypatch.context() as m:
        rows_on, out_on, not_decode = _chunked_run(True, m)
    with monkeypatch.context() as m:
        rows_off, out_off, _ = _chunked_run(False, m)
    assert not_decode >= 1  # (rare in the engine: the rows of a step that is not a decode are seldom the batch's)
    assert rows_on == rows_off and out_on == out_off


def _prefill_in_chunks(columns: bool) -> tuple[list[str], ControlState, int]:
    """Hand-made events: 16 requests admitted at once, their prompts fed 5 tokens a step over the whole batch (rows
    unsampled, end < ntok: the non-decode `advance`), the last chunk sampling, then decodes. Each event's digest and the
    sequences' cursors after it (the full audit passing), the state after them; the number of StepExecuted the batch
    columns advanced."""
    sink = RecordingSink()
    caps = null_workload.run(1, lambda i: 4, sink=sink)
    state = ControlState.create(caps)
    state.batch_cache = columns
    n, plen = 16, 33
    digests = []
    advanced = 0
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True).to_json()
    events: list = [RequestArrivedEvent(f"r{i}", i, tuple((i * 7 + k) % 200 + 1 for k in range(plen)), params, 8)
                    for i in range(n)]
    ids = tuple(range(n))
    fed_at = [5, 5, 5, 5, 5, 5, 3, 1, 1, 1]  # 16 rows x 5 within the workload's max_batch_tokens (96)
    free = list(state.pool.free)
    held = [0] * n
    index = 0
    for e in events:
        check_invariants(state, state.apply(e), index)
        digests.append(state.digest())
        index += 1
    done = 0
    for step, fed in enumerate(fed_at):
        alloc = []
        for i in range(n):  # blocks for the KV this step writes
            while held[i] * caps.block_size < done + fed:
                alloc.append((i, free.pop(0)))
                held[i] += 1
        plan = StepPlanned(step, ids if step == 0 else (), ids, (fed,) * n, tuple(alloc), (), ())
        done += fed
        sampled = done >= plen  # a row samples once every prompt token is fed
        tokens = tuple((65 + i) if sampled else -1 for i in range(n))
        for e in (plan, StepExecuted(step, tokens)):
            cols = state.batch
            check_invariants(state, state.apply(e), index)
            if isinstance(e, StepExecuted) and cols is not None and state.batch is cols:
                advanced += 1
            audit(state, index)  # every sequence's fingerprint is its fields' (the columns wrote the objects right)
            digests.append(state.digest())
            digests.append(repr([(q.cursor.computed, q.qsa.ingested, len(q.cursor.tokens), q.cursor.token_hash)
                                 for q in state.seqs.values()]))
            index += 1
    return digests, state, advanced


def test_chunks_over_the_batch_columns_are_the_objects_path() -> None:
    on, state_on, advanced = _prefill_in_chunks(True)
    off, state_off, _ = _prefill_in_chunks(False)
    assert advanced >= 3  # the chunks after the first (the columns gathered after it) and the decodes
    assert on == off
    assert state_on.seqs == state_off.seqs  # every sequence's fields (cursors, token hashes, fingerprints, blocks)
    assert state_on.seq_digest == state_off.seq_digest and state_on.pool == state_off.pool


@pytest.mark.parametrize("owed", ["release", "restore"])
def test_a_plan_that_leaves_out_what_is_owed_is_refused(owed: str) -> None:
    """_check_plan's release and restore tests, now skipped when both sides are empty: a plan naming nothing while a
    finished sequence's release (or a rollback's restore) is owed is still refused, and moves nothing."""
    caps = derive_capacities(EngineConfig(max_seq_len=64, max_batch_size=4, prefill_chunk_tokens=16, block_size=8,
                                          num_kv_blocks=10))
    state = ControlState.create(caps)
    params = SamplingParams(max_tokens=8).to_json()
    state.apply(RequestArrivedEvent("a", 0, (1, 2, 3), params, 8))
    state.apply(RequestArrivedEvent("b", 1, (4, 5), params, 8))
    state.apply(StepPlanned(0, (0, 1), (0, 1), (3, 2), ((0, 0), (1, 1)), (), ()))
    state.apply(StepExecuted(0, (7, 8)))
    if owed == "release":
        state.apply(RequestFinished(1, "stop", "stop token"))
        assert state.pending_release == [1]
        plan, why = StepPlanned(1, (), (0,), (1,), (), (), ()), "releases exactly"
    else:
        state.apply(RequestFinished(1, "stop", "stop token"))
        state.apply(StepPlanned(1, (), (0,), (1,), (), (1,), ()))
        state.apply(StepExecuted(1, (9,)))
        state.orders.rollbacks.append(RingRestore(0, 0, 2))  # a rollback queued for the next plan
        plan, why = StepPlanned(2, (), (0,), (1,), (), (), ()), "restores exactly"
    before = copy.deepcopy(state)
    with pytest.raises(TransitionRefused, match=why):
        state.apply(plan)
    assert state == before and state.digest() == before.digest()
