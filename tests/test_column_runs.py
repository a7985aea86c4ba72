"""Runs of step events applied at once (atlas.state.column_runs, found by atlas.replay.runs): `replay check` over a
codec-1 trace gives the recorded digest after every event and the scalar path's typed state, and a trace broken
inside a run gets exactly the report the event-by-event path gives (same event, machine, message and numbers)."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import attrs
import numpy as np
import pytest
from fixtures import null_workload

from atlas.config import Capacities
from atlas.replay import codec, verify
from atlas.replay.reader import TraceReader
from atlas.replay.runs import MIN_RUN, run_end
from atlas.state import column_run_cursors, column_runs
from atlas.state.control import ControlState
from atlas.state.events import StepExecuted, StepPlanned
from atlas.state.invariants import audit, check_invariants

REQUESTS = 24  # batches of 20 (more than steps.VECTOR_MIN), blocks of 8: runs of decodes that allocate as they go


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("runs") / "run.db"
    null_workload.run(REQUESTS, lambda i: 24 + i % 9, trace=str(path))
    return path


def _rows(path: Path) -> tuple[Capacities, list[tuple]]:
    reader = TraceReader(path)
    try:
        run = reader.run()
        return Capacities.from_table(run.capacities), reader.stored_rows(run.run_id)
    finally:
        reader.close()


def _event(row: tuple):  # type: ignore[no-untyped-def]
    return codec.load_event(row[2], row[3], row[4])


def _runs(caps: Capacities, rows: list[tuple]) -> list[tuple[int, int]]:
    """Where check_state_only finds runs: (first row, end row) of each, applying the rest one at a time."""
    state = ControlState.create(caps)
    state.columnar = True
    found, i = [], 0
    while i < len(rows):
        cols = state.columns
        if cols is not None and rows[i][2] == "step_planned" and cols.fed is None:
            j = run_end(rows, i, cols.ids)
            if j - i >= 2 * MIN_RUN:
                found.append((i, j))
                assert column_runs.apply_run(state, [r[4] for r in rows[i:j:2]], [r[4] for r in rows[i + 1:j:2]],
                                             [r[5] for r in rows[i:j]])
                i = j
                continue
        check_invariants(state, state.apply(_event(rows[i])), rows[i][0])
        assert state.digest() == rows[i][5]
        i += 1
    return found


def _fields(state: ControlState) -> dict[int, tuple]:
    return {s.seq_id: (list(s.cursor.tokens), s.cursor.computed, s.cursor.token_hash, s.qsa.ingested,
                       list(s.blocks), s.fingerprint) for s in state.seqs.values()}


def _scalar(caps: Capacities, rows: list[tuple]) -> ControlState:
    state = ControlState.create(caps)
    for row in rows:
        check_invariants(state, state.apply(_event(row)), row[0])
    return state


def test_a_run_gives_every_recorded_digest_and_the_typed_state(trace: Path) -> None:
    caps, rows = _rows(trace)
    runs = _runs(caps, rows)  # asserts each run applied whole and every other event's digest
    assert runs and max(j - i for i, j in runs) >= 20  # steps of a full batch, applied as a run
    i, j = max(runs, key=lambda r: r[1] - r[0])
    assert any(len(_event(rows[k]).alloc) for k in range(i, j, 2))  # the run allocates blocks as it goes
    state = ControlState.create(caps)
    state.columnar = True
    for row in rows[:i]:
        check_invariants(state, state.apply(_event(row)), row[0])
    assert state.columns is not None
    assert column_runs.apply_run(state, [r[4] for r in rows[i:j:2]], [r[4] for r in rows[i + 1:j:2]],
                                 [r[5] for r in rows[i:j]])
    assert state.digest() == rows[j - 1][5]
    state.flush_columns()
    scalar = _scalar(caps, rows[:j])
    assert _fields(state) == _fields(scalar) and state.digest() == scalar.digest()
    assert sorted(state.pool.free) == sorted(scalar.pool.free) and state.pool.used == scalar.pool.used
    assert (state.step, state.inflight, state.pending_release) == (scalar.step, None, [])
    audit(state, j)


def _before_first_run(trace: Path):
    """The trace's rows, its first run [i, j), and a columnar state that applied every row before it."""
    caps, rows = _rows(trace)
    i, j = _runs(caps, rows)[0]
    state = ControlState.create(caps)
    state.columnar = True
    for row in rows[:i]:
        check_invariants(state, state.apply(_event(row)), row[0])
    return caps, rows, i, j, state


def test_the_row_by_row_tail_reads_what_the_common_one_reads(trace: Path) -> None:
    caps, rows, i, j, state = _before_first_run(trace)
    plans = [r[4] for r in rows[i:j:2]]
    n = len(state.columns.ids)
    sizes = np.array([len(p) >> 2 for p in plans])
    o = np.cumsum(sizes) - sizes
    A = np.frombuffer(b"".join(p[1:] for p in plans), dtype="<i4")
    head = 3 + 2 * n
    fast = column_runs._allocations(state, state.columns, A, o + head, sizes - head)
    rows_ = column_runs._allocations_rows(state, state.columns, A, o + head, sizes - head)
    assert fast is not None and rows_ is not None and fast[1].size  # blocks given in the run
    assert fast[5] and not rows_[5]  # the common tail's blocks one a row, as ints; the rows' as lists
    assert [[x] for x in fast[3]] == rows_[3]
    for a, b in zip(fast[:3] + fast[4:5], rows_[:3] + rows_[4:5], strict=True):
        assert (np.asarray(a) == np.asarray(b)).all()


def _broken(trace: Path, tmp: Path, how: str) -> tuple[Path, int, int]:
    """A copy of the trace with one event inside the longest run changed; (path, run start, run end)."""
    caps, rows = _rows(trace)
    i, j = max(_runs(caps, rows), key=lambda r: r[1] - r[0])
    k = i + 2 * ((j - i) // 4)  # a plan in the run's middle
    plan, done = _event(rows[k]), _event(rows[k + 1])
    assert isinstance(plan, StepPlanned) and isinstance(done, StepExecuted)
    m = len(plan.seqs) // 2
    target, digest = k, None
    if how == "fed past the tokens":
        e = attrs.evolve(plan, fed=plan.fed[:m] + (plan.fed[m] + 5,) + plan.fed[m + 1:])
    elif how == "no fed":
        e = attrs.evolve(plan, fed=plan.fed[:m] + (0,) + plan.fed[m + 1:])
    elif how == "missing token":
        target, e = k + 1, attrs.evolve(done, tokens=done.tokens[:m] + (-1,) + done.tokens[m + 1:])
    elif how == "block past the tokens":  # two more free blocks: a valid plan whose state breaks an invariant
        state = _scalar(caps, rows[:k])
        row = [r for r in plan.alloc if r[0] == plan.seqs[m]]
        rest = tuple(r for r in plan.alloc if r[0] != plan.seqs[m])
        extra = tuple(sorted(state.pool.free)[-2:])
        e = attrs.evolve(plan, alloc=(*rest, (plan.seqs[m], *(row[0][1:] if row else ()), *extra)))
    elif how == "block taken twice":  # a later plan of the run allocates a block an earlier one gave: refused
        given = [(t, _event(rows[t]).alloc) for t in range(i, j, 2) if _event(rows[t]).alloc]
        (_, earlier), (target, alloc) = given[len(given) // 2 - 1], given[len(given) // 2]
        taken = (alloc[0][0], earlier[0][1], *alloc[0][2:])
        e = attrs.evolve(_event(rows[target]), alloc=(taken, *alloc[1:]))
    else:  # "digest": the trace claims another state after an execution
        target, e, digest = k + 1, done, "0123456789abcdef"
    payload = codec.encode(e)
    assert payload is not None and type(payload) is bytes  # still codec 1: the run reads it as a blob
    path = tmp / f"{how.replace(' ', '_')}.db"
    shutil.copy(trace, path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE events SET payload = ?, digest = COALESCE(?, digest) WHERE idx = ?",
                     (payload, digest, rows[target][0]))
    return path, rows[i][0], rows[j - 1][0]


@pytest.mark.parametrize("how", ["fed past the tokens", "no fed", "missing token", "block past the tokens",
                                 "block taken twice", "digest"])
def test_a_broken_run_is_reported_as_event_by_event(trace: Path, tmp_path: Path, how: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path, first, last = _broken(trace, tmp_path, how)
    tried = []
    real = verify.apply_run

    def apply_run(*args):  # type: ignore[no-untyped-def]
        tried.append(real(*args))
        return tried[-1]

    monkeypatch.setattr(verify, "apply_run", apply_run)
    with_runs = verify.check_state_only(path)
    assert False in tried  # the broken run was tried whole and given back
    monkeypatch.setattr(verify, "MIN_RUN", 10**9)  # every event one at a time
    tried.clear()
    without = verify.check_state_only(path)
    assert not tried
    assert with_runs.problem is not None and first <= with_runs.index <= last
    assert with_runs == without
    assert check_ok(trace)


def check_ok(trace: Path) -> bool:
    return verify.check_state_only(trace).problem is None


def test_a_run_given_back_moves_nothing(trace: Path) -> None:
    caps, rows, i, j, state = _before_first_run(trace)
    before = state.digest()
    plans = [r[4] for r in rows[i:j:2]]
    last = _event(rows[j - 2])
    plans[-1] = codec.encode(attrs.evolve(last, fed=(0,) + last.fed[1:]))  # the run's last plan feeds nothing
    assert not column_runs.apply_run(state, plans, [r[4] for r in rows[i + 1:j:2]], [r[5] for r in rows[i:j]])
    assert state.columns is None and state.digest() == before  # flushed, nothing moved
    scalar = _scalar(caps, rows[:i])
    assert _fields(state) == _fields(scalar) and state.step == scalar.step
    assert sorted(state.pool.free) == sorted(scalar.pool.free)


def test_the_token_hash_rows_are_the_recurrence() -> None:
    """column_run_cursors.token_hash_rows (the token hashes of a chunk of steps in closed form) against the step-at-a-time
    recurrence h' = h * FNV + t + 1 (h' = h when nothing is sampled) over uint64, for chunks of 1 to 65 steps."""
    rng = np.random.default_rng(7)
    for steps in (1, 2, 3, 5, 31, 64, 65):
        sampled = rng.random((steps, 9)) < 0.8
        sampled[:, 0] = True  # a row sampling every step (a decode)
        tokens = np.where(sampled, rng.integers(0, 2**31 - 1, (steps, 9)), -1).astype(np.int64)
        h0 = rng.integers(0, 2**63, 9, dtype=np.uint64)
        h, expected = [int(x) for x in h0], []
        for k in range(steps):
            h = [(x * 0x100000001B3 + int(t) + 1) % 2**64 if s else x
                 for x, t, s in zip(h, tokens[k], sampled[k], strict=True)]
            expected.append(h)
        out = np.empty((steps, 9), dtype=np.uint64)
        column_run_cursors.token_hash_rows(h0, sampled, tokens, out)
        assert out.tolist() == expected


def _decode_case(rng: np.random.Generator, n: int, m: int, bs: int) -> tuple:
    """Columns of n decoding rows and m steps of a valid decode run over them: every row fed 1, sampling every step,
    a block given at the step whose token needs it."""
    ntok = rng.integers(20, 200, n)
    comp = ntok - 1
    nb = -(-ntok // bs)
    cols = type("Cols", (), {})()
    cols.computed, cols.ntok, cols.nblocks = comp, ntok, nb
    cols.token_hash = rng.integers(0, 2**63, n, dtype=np.uint64)
    cols.fp = rng.integers(0, 2**63, n, dtype=np.uint64)
    cols.hid = rng.integers(0, 2**63, n, dtype=np.uint64)
    cols.capacity = comp + m + rng.integers(0, 3, n)
    cols.budget_end = ntok + m + rng.integers(0, 3, n)
    F = np.ones((m, n), dtype=np.int32)
    T = rng.integers(0, 2**31 - 1, (m, n)).astype(np.int32)
    G = np.zeros((m, n), dtype=np.int64)
    held = nb.copy()
    for k in range(m):
        short = comp + k + 1 > held * bs
        G[k, short] = 1
        held += short
    return cols, F, T, G


def _both(cols, F, T, G, bs):  # type: ignore[no-untyped-def]
    """run_cursors' result the general way and with decode chunks: (final cursors or None, seq_x, delta_p) each."""
    kk, rr = (x.astype(np.int64) for x in np.nonzero(G))
    got = []
    for decode in (False, True):
        column_run_cursors.DECODE_CHUNKS = decode
        try:
            seq_x, delta_p = np.zeros(len(F), dtype=np.uint64), np.zeros(len(F), dtype=np.uint64)
            final = column_run_cursors.run_cursors(cols, F, T, G, kk, rr, bs, seq_x, delta_p)
        finally:
            column_run_cursors.DECODE_CHUNKS = True
        got.append((None if final is None else [x.tolist() for x in final], seq_x.tolist(), delta_p.tolist()))
    return got


@pytest.mark.parametrize("break_", ["none", "pending prompt", "past capacity", "past budget", "block late",
                                    "block early", "no token", "fed 2", "computed ahead"])
def test_decode_chunks_are_the_general_chunks(break_: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """column_run_cursors._decode_chunk (a chunk of steps every row decodes through: no cumulative sums of the fed and
    sampled counts, no table gathers) gives what the general chunk gives: the same cursors, fingerprint XORs and
    allocation deltas when the run holds, None exactly when the general chunk fails (a row still prefilling, past
    its QSA capacity or its budget, a block given a step late or early, an unsampled token, a fed count of 2, a row
    computed ahead of its tokens), over chunks of 1, 7 and 64 steps, a 100-step run in two chunks."""
    rng = np.random.default_rng(11)
    taken = []
    real = column_run_cursors._decode_chunk
    monkeypatch.setattr(column_run_cursors, "_decode_chunk", lambda *a: taken.append(real(*a) is not None) or real(*a))
    for m, n in ((1, 5), (7, 16), (64, 64), (100, 64)):
        cols, F, T, G = _decode_case(rng, n, m, 4)
        k, r = m // 2, n // 3
        if break_ == "pending prompt":
            cols.computed = cols.computed.copy()
            cols.computed[r] -= 1
        elif break_ == "past capacity":
            cols.capacity[r] = cols.computed[r] + m - 1
        elif break_ == "past budget":
            cols.budget_end[r] = cols.ntok[r] + m - 1
        elif break_ in ("block late", "block early"):
            given = np.flatnonzero(G[:, r])
            if break_ == "block early":  # a step before its token (its block then starts empty: no block past them)
                if len(given) and given[0] > 0:
                    G[given[0], r] = 0
                    G[given[0] - 1, r] = 1
                else:
                    G[0, r] += 1
            elif len(given):
                G[given[0], r] = 0
                G[min(m - 1, given[0] + 1), r] += 0 if given[0] + 1 >= m else 1
            else:
                continue  # no block due in this chunk
        elif break_ == "no token":
            T[k, r] = -1
        elif break_ == "fed 2":
            F[k, r] = 2
        elif break_ == "computed ahead":
            cols.computed = cols.computed.copy()
            cols.computed[r] += 1
        general, decode = _both(cols, F, T, G, 4)
        assert decode == general
        assert (general[0] is None) == (break_ != "none")
    if break_ == "none":
        assert taken and all(taken)  # every chunk went the decode way
