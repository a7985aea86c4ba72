"""Replay check's fifth pass: arrivals at once (atlas.state.column_arrivals), finishes and admission plans in the step
columns without a flush (atlas.state.column_batch), the plain-sqlite3 read. On a codec-1 null-engine run whose batch
changes under the columns: every recorded digest and, cut anywhere, the scalar path's typed state; a trace broken at
an arrival, a finish or an admission plan gets exactly the report the scalar path gives (event, machine, message,
numbers)."""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from fixtures import null_workload

from atlas.config import Capacities, EngineConfig
from atlas.errors import TraceFileError, UnknownEvent
from atlas.hashing import roll_tokens
from atlas.registry import build_engine
from atlas.replay import arrivals, codec, digests, verify
from atlas.replay.reader import TraceReader, read_stored
from atlas.sampling.params import SamplingParams
from atlas.state import column_arrivals
from atlas.state.control import ControlState
from atlas.state.events import RequestArrived
from atlas.state.invariants import audit

_CAPS = {"max_seq_len": 128, "max_batch_size": 20, "max_batch_tokens": 96, "block_size": 8, "num_kv_blocks": 320,
         "kv_blocks_per_seq": 16, "verify_width": 1, "drafter": "", "drafter_rows": 0, "qsa_index_capacity": 128,
         "qsa_ratio": 1, "qsa_budget": 0, "num_qsa_layers": 0, "ngram_size": 0, "ring_slots": 0, "snapshot_interval": 64,
         "max_waiting": 1024, "ring_slot_bytes": 0, "prefix_caching": False, "prefix_snapshots": 0,
         "drafter_context": True, "prefill_align": 0}
REQUESTS = 40  # batches of 20 (more than VECTOR_MIN): finishes one or a few at a time, admissions behind them


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("batch") / "run.db"
    null_workload.run(REQUESTS, lambda i: 10 + (i * 7) % 23, trace=str(path))
    return path


def _rows(path: Path) -> tuple[Capacities, list[tuple]]:
    run, rows = read_stored(path)
    return Capacities.from_table(run.capacities), rows


class _Count:
    """Wraps one of verify's fast paths, recording what each call returned."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.real = getattr(verify, name)
        self.results: list = []
        monkeypatch.setattr(verify, name, self)

    def __call__(self, *args):  # type: ignore[no-untyped-def]
        self.results.append(self.real(*args))
        return self.results[-1]


def test_the_fast_paths_give_every_digest_and_the_scalar_state(trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    caps, rows = _rows(trace)
    arrivals = _Count(monkeypatch, "apply_parsed")  # the recorded arrivals are codec 1 (sixth pass)
    finishes = _Count(monkeypatch, "finish_text_in_columns")  # JSON finishes, no event built (sixth pass)
    plans = _Count(monkeypatch, "plan_in_columns")
    executions = _Count(monkeypatch, "execute_blob")  # the admission steps' executions, no event built (seventh)
    report, _ = verify.check_rows(caps, rows)
    assert report.problem is None  # every digest compared and matched
    assert any(arrivals.results) and sum(r is not None for r in finishes.results) >= 5
    admitting = [r for r in plans.results if r is not None]
    assert len(admitting) >= 3  # plans of a changed batch went through the columns
    assert sum(r is not None for r in executions.results) >= len(admitting)
    kinds = [r[2] for r in rows]
    admitted = [i for i, r in enumerate(rows) if r[2] == "step_planned" and codec.load_event(*r[2:5]).admitted]
    cuts = sorted({*range(0, len(rows) + 1, 29), len(rows)} | set([i + 1 for i, k in enumerate(kinds)
                                                                    if k == "request_finished"][::3])
                  | {i + 2 for i in admitted[::2]})  # right after an admission step's execution
    for k in cuts:  # the state after any prefix equals the scalar path's (every field: ControlState's eq)
        fast, state = verify.check_rows(caps, rows[:k])
        slow, scalar = verify.check_rows(caps, rows[:k], fast=False)
        assert fast == slow and fast.problem is None
        assert state == scalar and state.digest() == scalar.digest(), k
        assert list(state.pool.free) == list(scalar.pool.free)
        audit(state, k)


def test_arrivals_between_steps_leave_the_columns_as_the_scalar_path_leaves_the_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrivals in the middle of a run (two at a time, every few steps) are applied at once without flushing the
    step columns (they touch no running sequence): the same digests and, cut anywhere, the same state."""
    path = tmp_path / "interleaved.db"
    config = EngineConfig(max_seq_len=128, max_batch_size=20, prefill_chunk_tokens=96, block_size=8)
    engine = build_engine("atlas-tiny", backend="null", config=config, trace=str(path))
    added = steps = 0
    while added < 30 or engine.has_unfinished():
        if added < 30 and (added == 0 or steps % 3 == 0):
            for _ in range(2 if added else 18):
                engine.add_request(f"r{added}", [(added * 11 + k) % 190 + 1 for k in range(4 + added % 13)],
                                   SamplingParams(max_tokens=8 + added % 11, seed=added, ignore_eos=True))
                added += 1
        engine.step()
        steps += 1
    engine.close()
    caps, rows = _rows(path)
    kinds = [r[2] for r in rows]
    late = [i for i in range(1, len(rows)) if kinds[i] == "request_arrived" and kinds[i - 1] != "request_arrived"]
    assert len(late) >= 3  # arrivals came between steps
    real, seen = verify.apply_parsed, []  # codec-1 arrivals (the recorded form)

    def apply_parsed(state, *args):  # type: ignore[no-untyped-def]
        seen.append((state.columns is not None, real(state, *args)))
        return seen[-1][1]

    monkeypatch.setattr(verify, "apply_parsed", apply_parsed)
    assert verify.check_rows(caps, rows)[0].problem is None
    assert (True, True) in seen  # taken at once with the step columns held
    for k in sorted({*late, *(i + 2 for i in late), *range(0, len(rows) + 1, 31), len(rows)}):
        fast, state = verify.check_rows(caps, rows[:k])
        slow, scalar = verify.check_rows(caps, rows[:k], fast=False)
        assert fast == slow and fast.problem is None
        assert state == scalar, k


def _edit(trace: Path, tmp: Path, name: str, idx: int, payload: str | bytes | None = None, digest: str | None = None
          ) -> Path:
    path = tmp / f"{name}.db"
    shutil.copy(trace, path)
    conn = sqlite3.connect(path)
    try:
        with conn:
            if payload is not None:
                conn.execute("UPDATE events SET payload = ? WHERE idx = ?", (payload, idx))
            if digest is not None:
                conn.execute("UPDATE events SET digest = ? WHERE idx = ?", (digest, idx))
    finally:
        conn.close()  # the last connection closed: the WAL is checkpointed into the file (which is then copied)
    return path


def _broken(trace: Path, tmp: Path, how: str) -> Path:
    caps, rows = _rows(trace)
    arrivals = [r for r in rows if r[2] == "request_arrived"]
    middle = arrivals[len(arrivals) // 2]
    p = codec.decode("request_arrived", middle[3], middle[4])  # codec 1 as recorded; the edits write JSON back
    if how == "arrival past capacity":
        return _edit(trace, tmp, how, middle[0], json.dumps({**p, "max_new": caps.max_seq_len}))
    if how == "arrival out of order":
        return _edit(trace, tmp, how, middle[0], json.dumps({**p, "seq_id": p["seq_id"] + 1}))
    if how == "request id live":
        live = codec.decode("request_arrived", arrivals[0][3], arrivals[0][4])["request_id"]
        return _edit(trace, tmp, how, middle[0], json.dumps({**p, "request_id": live}))
    if how == "arrival digest":
        return _edit(trace, tmp, how, middle[0], digest="0123456789abcdef")
    if how == "arrival prompt spaced":  # the same event in another JSON form: parsed by json.loads, still passes
        return _edit(trace, tmp, how, middle[0], json.dumps(p, separators=(", ", ": ")))
    if how == "float token":
        text = json.dumps(p, separators=(",", ":"))
        return _edit(trace, tmp, how, middle[0], text.replace('"prompt":[', '"prompt":[1.5,', 1))
    e = codec.load_event("request_arrived", middle[3], middle[4])
    if how == "binary arrival past capacity":  # still codec 1: the binary run checks it
        return _edit(trace, tmp, how, middle[0], codec.encode(_evolve(e, max_new=caps.max_seq_len)))
    if how == "binary params refused":  # top_p 0: SamplingParams refuses it (an error raised, as one at a time)
        return _edit(trace, tmp, how, middle[0], codec.encode(_evolve(e, params={**e.params, "top_p": 0.0})))
    if how == "binary arrival garbled":  # a length that does not add up: the codec refuses the row when reached
        raw = bytearray(middle[4])
        raw[-40] ^= 0x7F
        return _edit(trace, tmp, how, middle[0], bytes(raw[:-1]))
    # the finishes and the admission plans behind them (after the first plan the columns took whole)
    admits = [r for r in rows if r[2] == "step_planned" and codec.load_event(*r[2:5]).admitted]
    late = [r for r in admits if any(q[2] == "request_finished" for q in rows[:r[0]])]
    plan_row = late[len(late) // 2]
    finish = next(r for r in reversed(rows[:plan_row[0]]) if r[2] == "request_finished")
    f = json.loads(finish[4])
    if how == "finish reason":
        return _edit(trace, tmp, how, finish[0], json.dumps({**f, "reason": "error"}), None)
    if how == "finish unknown":
        return _edit(trace, tmp, how, finish[0], json.dumps({**f, "seq_id": 10**6}))
    if how == "finish digest":
        return _edit(trace, tmp, how, finish[0], digest="fedcba9876543210")
    if how == "finish spaced":  # whitespace around and inside: json.loads takes it, the finish's own scan does not
        return _edit(trace, tmp, how, finish[0], " " + json.dumps(f, separators=(" , ", " : ")) + "\n")
    if how == "finish trailing text":  # json.loads refuses it (an error raised, as one at a time)
        return _edit(trace, tmp, how, finish[0], finish[4] + " x")
    e = codec.load_event(*plan_row[2:5])
    x_row = rows[rows.index(plan_row) + 1]
    x = codec.load_event(*x_row[2:5])
    assert x_row[2] == "step_executed" and isinstance(x_row[4], bytes)
    if how == "admission step's token missing":  # the last admitted sequence's prompt all fed, nothing sampled
        return _edit(trace, tmp, how, x_row[0], codec.encode(_evolve(x, tokens=(*x.tokens[:-1], -1))))
    if how == "admission step's token for the wrong step":
        return _edit(trace, tmp, how, x_row[0], codec.encode(_evolve(x, step=x.step + 1)))
    if how == "admission step's accepted counts":  # accepted drafts without drafts (a refusal)
        n = len(x.tokens)
        return _edit(trace, tmp, how, x_row[0], codec.encode(_evolve(x, accepted=(1,) * n, verdicts=(0,) * n)))
    if how == "admission step's execution digest":
        return _edit(trace, tmp, how, x_row[0], digest="0000000000000abc")
    rows_of = {row[0]: i for i, row in enumerate(e.alloc)}
    r = max((rows_of[s] for s in e.admitted if s in rows_of), key=lambda i: len(e.alloc[i]))
    row = e.alloc[r]
    if how == "admitted KV past its blocks":  # its last block taken away
        assert len(row) >= 3
        alloc = (*e.alloc[:r], row[:-1], *e.alloc[r + 1:])
        return _edit(trace, tmp, how, plan_row[0], codec.encode(_evolve(e, alloc=alloc)))
    if how == "admitted block past the tokens":  # two more free blocks (the pool's last): a violation, not a refusal
        alloc = (*e.alloc[:r], (*row, caps.num_kv_blocks - 1, caps.num_kv_blocks - 2), *e.alloc[r + 1:])
        return _edit(trace, tmp, how, plan_row[0], codec.encode(_evolve(e, alloc=alloc)))
    if how == "admitted block not free":
        row = e.alloc[-1]
        alloc = (*e.alloc[:-1], (row[0], caps.num_kv_blocks, *row[2:]))  # past the pool
        return _edit(trace, tmp, how, plan_row[0], codec.encode(_evolve(e, alloc=alloc)))
    if how == "admission of a running sequence":
        return _edit(trace, tmp, how, plan_row[0], codec.encode(_evolve(e, admitted=(e.seqs[0], *e.admitted[1:]))))
    if how == "plan names a finished sequence":  # the batch before the finish, its block count unchanged
        before = next(codec.load_event(*r[2:5]) for r in reversed(rows[:finish[0]]) if r[2] == "step_planned")
        fed = dict(zip(e.seqs, e.fed, strict=True))
        return _edit(trace, tmp, how, plan_row[0], codec.encode(_evolve(
            e, admitted=(), seqs=before.seqs, fed=tuple(fed.get(s, 1) for s in before.seqs),
            alloc=tuple(row for row in e.alloc if row[0] in before.seqs))))
    assert how == "admission digest"
    return _edit(trace, tmp, how, plan_row[0], digest="00000000000000ff")


def _evolve(e, **kw):  # type: ignore[no-untyped-def]
    import attrs

    return attrs.evolve(e, **kw)


BREAKS = ["arrival past capacity", "arrival out of order", "request id live", "arrival digest", "arrival prompt spaced",
          "float token", "binary arrival past capacity", "finish reason", "finish unknown", "finish digest",
          "finish spaced", "admitted KV past its blocks",
          "admitted block past the tokens", "admitted block not free", "admission of a running sequence",
          "admission digest", "plan names a finished sequence", "admission step's token missing",
          "admission step's token for the wrong step", "admission step's accepted counts",
          "admission step's execution digest"]


@pytest.mark.parametrize("how", BREAKS)
def test_a_break_is_reported_as_the_scalar_path_reports_it(trace: Path, tmp_path: Path, how: str) -> None:
    path = _broken(trace, tmp_path, how)
    caps, rows = _rows(path)
    fast, _ = verify.check_rows(caps, rows)
    slow, _ = verify.check_rows(caps, rows, fast=False)
    assert fast == slow
    if how == "float token":  # a row whose payload is not its event: the check names it (exit 2), as every reader
        with pytest.raises(TraceFileError, match=r"event \d+ \(request_arrived v2\): field prompt is \[1\.5"):
            verify.check_state_only(path)
    else:
        assert verify.check_state_only(path) == slow
    if how in ("arrival prompt spaced", "finish spaced"):
        assert slow.problem is None
    elif how == "float token":  # the converter takes 1.5 as 1: the recorded digest no longer matches
        assert slow.problem is not None and "digest" in slow.problem
    else:
        assert slow.problem is not None
    expected = {"admitted KV past its blocks": "KV written past the sequence's blocks",
                "admitted block past the tokens": "no block beyond the sequence's tokens",
                "admitted block not free": "allocation of a block that is not free"}.get(how)
    assert expected is None or expected in slow.problem


@pytest.mark.parametrize("how", ["binary params refused", "binary arrival garbled", "finish trailing text"])
def test_an_arrival_that_cannot_be_built_raises_as_one_at_a_time(trace: Path, tmp_path: Path, how: str) -> None:
    caps, rows = _rows(_broken(trace, tmp_path, how))
    errors = (UnknownEvent,) if how == "binary arrival garbled" else (ValueError,)
    with pytest.raises(errors) as fast:
        verify.check_rows(caps, rows)
    with pytest.raises(errors) as slow:
        verify.check_rows(caps, rows, fast=False)
    assert str(fast.value) == str(slow.value)


def test_params_validated_once_per_text_are_from_json() -> None:
    """Codec-1 params differing only in the seed share one validation (atlas.replay.arrivals.params_of): each is
    SamplingParams.from_json of its own recorded dict, key order and all, whatever came first."""
    cache: arrivals.ParamsCache = {}
    base = [SamplingParams(temperature=0.7, seed=1, stop=("x",)).to_json(), SamplingParams(top_k=3).to_json(),
            {"temperature": 0.5}, {"seed": 4, "top_p": 0.5}]
    for k in range(40):
        params = {**base[k % 4]}
        if "seed" in params:
            params["seed"] = k // 3 - 5
        e = RequestArrived(request_id=f"r{k}", seq_id=k, prompt=(1, 2), params=params, max_new=3)
        f = codec.arrived_fields(codec.encode(e))
        assert f is not None
        got = arrivals.params_of(cache, f[7], f[4], f[2])
        assert got == SamplingParams.from_json(params) and got.seed == params.get("seed", 0)
        assert codec.decode("request_arrived", 2, codec.encode(e)) == json.loads(e.payload_json())
    assert len(cache) == 4


@pytest.mark.parametrize("batch", [1, 3, 4096])
def test_a_digest_is_reported_before_a_later_refusal(trace: Path, tmp_path: Path, batch: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The digests of events applied one at a time are compared in batches (atlas.replay.digests): a wrong one is
    still the report when a later event is refused, an error is raised, or the trace ends, whatever the batch."""
    monkeypatch.setattr(digests, "BATCH", batch)
    caps, rows = _rows(trace)
    finishes = [r for r in rows if r[2] == "request_finished"]
    early = finishes[len(finishes) // 3]
    path = _edit(trace, tmp_path, "early", early[0], digest="0000000000000001")
    later = finishes[2 * len(finishes) // 3]
    f = json.loads(later[4])
    broken = _edit(path, tmp_path, "both", later[0], json.dumps({**f, "seq_id": 10**6}))
    garbled = _edit(path, tmp_path, "garbled", later[0], "{not json")
    for p in (path, broken, garbled):
        c, r = _rows(p)
        fast, _ = verify.check_rows(c, r)
        assert fast.index == early[0] and "!= recorded 0000000000000001" in fast.problem
        if p != garbled:  # one at a time, the garbled row is never reached either
            assert fast == verify.check_rows(c, r, fast=False)[0]
    with pytest.raises(ValueError):  # no earlier digest differs: the error is raised as one at a time
        c, r = _rows(_edit(trace, tmp_path, "garbled-only", later[0], "{not json"))
        verify.check_rows(c, r)


def test_a_batch_of_digests_is_digest() -> None:
    state = ControlState.create(Capacities.from_table(json.loads(json.dumps(_CAPS))))
    lazy = digests.LazyDigests()
    rng = random.Random(3)
    expected = []
    for k in range(40):
        state.step, state.next_seq_id, state.finished_count = k, 3 * k, k // 2
        state.inflight_hash, state.outcomes_hash = rng.getrandbits(64), rng.getrandbits(64)
        state.seq_digest = rng.getrandbits(64)
        state.waiting = list(range(k % 5))
        state.dead = k == 39
        expected.append(state.digest())
        assert lazy.add(state, expected[-1] if k != 17 else "f" * 16, 100 + k) is None
    assert lazy.first_mismatch() == (117, expected[17], "f" * 16) and lazy.first_mismatch() is None
    row = (1 << 70, 2, 3, 4, 5)  # past 64 bits: the Python rounds (mix64 masks)
    lazy.inputs, lazy.recorded, lazy.indices = [row], ["x"], [9]
    assert lazy.first_mismatch() == (9, digests._digest(*row), "x")


def test_token_hashes_are_roll_tokens() -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(-2**63, 2**63) if rng.random() < 0.1 else rng.randrange(300)
                for _ in range(rng.randrange(1, 70))] for _ in range(50)]
    flat = np.array([t for p in prompts for t in p], dtype=np.int64)
    got = column_arrivals.token_hashes(flat, np.array([len(p) for p in prompts], dtype=np.int64)).tolist()
    assert got == [roll_tokens(0, p) for p in prompts]


def test_the_sqlite_read_is_the_readers(trace: Path) -> None:
    run, rows = read_stored(trace)
    reader = TraceReader(trace)
    try:
        assert run == reader.run() and rows == reader.stored_rows(run.run_id)
    finally:
        reader.close()
    with pytest.raises(FileNotFoundError):
        read_stored(trace.with_name("absent.db"))
    with pytest.raises(LookupError, match="no run 7"):
        read_stored(trace, 7)


def test_json_arrivals_still_go_at_once(trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run with every payload JSON (jsonl export and import: a trace recorded before codec-1 arrivals):
    its arrivals go through the JSON run, every digest matches, and it ends in the codec-1 trace's state."""
    from atlas.replay.jsonl import export_jsonl, import_jsonl

    lines, copy = tmp_path / "run.jsonl", tmp_path / "json.db"
    export_jsonl(trace, lines)
    import_jsonl(lines, copy)
    caps, rows = _rows(copy)
    assert all(type(r[4]) is str for r in rows)
    arrivals = _Count(monkeypatch, "apply_arrivals")
    report, state = verify.check_rows(caps, rows)
    assert report.problem is None and any(arrivals.results)
    assert state == verify.check_rows(*_rows(trace))[1]


def test_an_admission_plans_key_off_its_blob_is_ints_key(trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """plan_in_columns hashes the in-flight plan off its codec-1 blob (eighth pass): the same key as ints_key over
    the event's rows, for plans of any shape without drafts or restored sequences, and taken by the admission
    plans of a check (whose digests all match)."""
    from atlas.hashing import ints_key
    from atlas.state import column_batch
    from atlas.state.events import StepPlanned

    rng = random.Random(8)
    for _ in range(500):
        n = rng.randint(0, 70)
        seqs = tuple(rng.sample(range(1000), n))
        alloc = tuple((s, *rng.sample(range(4096), rng.randint(0, 4))) for s in rng.sample(seqs, min(n, 8)))
        e = StepPlanned(step=rng.randint(0, 10**6), admitted=tuple(rng.sample(range(1000), rng.randint(0, 5))),
                        seqs=seqs, fed=tuple(rng.randint(1, 600) for _ in seqs), alloc=alloc,
                        release=tuple(rng.sample(range(100), rng.randint(0, 3))),
                        reset=tuple(rng.sample(range(100), rng.randint(0, 3))), drafts=(), restored=())
        assert column_batch.plan_key_of_blob(codec.encode(e)) == ints_key(
            b"atlas.plan", (e.seqs, e.fed, *e.alloc, e.release, e.reset, e.restored, *e.drafts))
    keys = []
    real = column_batch.plan_key_of_blob
    monkeypatch.setattr(column_batch, "plan_key_of_blob", lambda b: keys.append(real(b)) or keys[-1])
    caps, rows = _rows(trace)
    assert verify.check_rows(caps, rows)[0].problem is None and len(keys) >= 3
