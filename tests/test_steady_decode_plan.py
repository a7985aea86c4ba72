"""The engine's decode steps over the batch columns: `batch` decides the running queue from the columns (short rows
taking one block each) exactly as its loop over the objects does; runs with the columns on and off record the same
events, digests and outputs. Workloads with short rows (a block allocated in the step), finishes, a waiting queue
(admissions), a pool small enough to preempt, and a step that releases finished sequences."""

from __future__ import annotations

import attrs
import pytest
from fixtures import null_workload

from atlas.config import EngineConfig
from atlas.engine.records import RecordingSink
from atlas.errors import InvariantViolation
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state import batch_columns
from atlas.state.control import ControlState
from atlas.state.events import StepPlanned

WORKLOADS = {
    # 20 rows, blocks of 8: every 8th step allocates for every row; budgets differ, so rows finish one by one
    "finishes": (EngineConfig(max_seq_len=96, max_batch_size=24, prefill_chunk_tokens=200, block_size=8),
                 20, lambda i: 20 + i % 7),
    # more requests than batch slots: waiting sequences are admitted as rows finish
    "waiting": (EngineConfig(max_seq_len=96, max_batch_size=20, prefill_chunk_tokens=400, block_size=8),
                28, lambda i: 10 + i),
    # a pool too small for every row's growth: batch preempts
    "preempt": (EngineConfig(max_seq_len=96, max_batch_size=20, prefill_chunk_tokens=200, block_size=8,
                             num_kv_blocks=70), 20, lambda i: 40 + i % 3),
}


def _run(name: str, columns: bool) -> tuple[list, list]:
    config, n, budget = WORKLOADS[name]
    sink = RecordingSink()
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=sink)
    engine.state.batch_cache = columns
    for i in range(n):
        engine.add_request(f"r{i}", [(i * 7 + k) % 150 + 1 for k in range(5 + i % 6)],
                           SamplingParams(max_tokens=budget(i), temperature=0.7, seed=i, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    engine.close()
    return [(i, s, e, d) for i, s, e, d in sink.rows], outputs


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_decode_steps_decided_from_the_batch_columns_are_the_loops(name: str) -> None:
    rows_on, out_on = _run(name, True)
    rows_off, out_off = _run(name, False)
    assert rows_on == rows_off and out_on == out_off  # same events, payloads, steps and digests; same outputs
    planned = [e for _, _, e, _ in rows_on if type(e).__name__ == "StepPlanned"]
    assert sum(len(e.alloc) > 1 for e in planned) >= 2  # rows took their blocks in one decode step
    field = {"finishes": "release", "waiting": "admitted", "preempt": "reset"}[name]
    assert any(getattr(e, field) for e in planned)  # the workload releases / admits / preempts


# ------------------------------------------------------------------ StepPlanned's allocation of many rows in one pass

_ALIGNED = (EngineConfig(max_seq_len=96, max_batch_size=20, prefill_chunk_tokens=400, block_size=8), 20)


def _aligned_run(columns: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, list[int], object]:
    """20 rows with prompts of one length: every row crosses a block boundary in the same steps."""
    config, n = _ALIGNED
    passes: list[int] = []  # the alloc rows of each StepPlanned BatchColumns.allocate took
    real = batch_columns.BatchColumns.allocate

    def counted(self, pool, alloc):  # type: ignore[no-untyped-def]
        done = real(self, pool, alloc)
        if done is not None:
            passes.append(len(alloc))
        return done

    monkeypatch.setattr(batch_columns.BatchColumns, "allocate", counted)
    sink = RecordingSink()
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=sink)
    engine.state.batch_cache = columns
    for i in range(n):
        engine.add_request(f"r{i}", [(i * 3 + k) % 150 + 1 for k in range(7)],
                           SamplingParams(max_tokens=30 + i % 3, temperature=0.7, seed=i, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    caps = engine.capacities
    engine.close()
    return list(sink.rows), outputs, passes, caps


def test_many_rows_allocated_in_one_pass_with_the_same_events_and_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    rows_on, out_on, passes, _ = _aligned_run(True, monkeypatch)
    rows_off, out_off, none, _ = _aligned_run(False, monkeypatch)
    assert rows_on == rows_off and out_on == out_off  # every digest equal to the objects' own refresh
    assert not none
    assert len(passes) >= 3 and max(passes) == 20  # whole-batch allocations took the one pass


def _apply(caps: object, events: list, on: bool, damage: int | None) -> tuple[list[str], tuple | None]:
    """The digests after every event and the first failure; at index `damage`, every alloc row of that StepPlanned
    gets one more block than it needs (from the free list, after the ones the plan takes)."""
    state = ControlState.create(caps)  # type: ignore[arg-type]
    state.batch_cache = on
    digests: list[str] = []
    for index, e in enumerate(events):
        if index == damage:
            planned = {b for row in e.alloc for b in row[1:]}
            spare = iter([b for b in reversed(state.pool.free) if b not in planned])
            e = attrs.evolve(e, alloc=tuple((*row, next(spare)) for row in e.alloc))
        failure = null_workload.apply_checked(state, e, index)
        if failure is not None:
            return digests, failure
        digests.append(state.digest())
    return digests, None


def test_a_block_too_many_named_as_without_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    rows, _, _, caps = _aligned_run(True, monkeypatch)
    events = [e for _, _, e, _ in rows]
    assert _apply(caps, events, True, None) == _apply(caps, events, False, None)
    i = next(i for i, e in enumerate(events) if isinstance(e, StepPlanned) and len(e.alloc) >= 4 and not e.admitted)
    on, failure_on = _apply(caps, events, True, i)
    off, failure_off = _apply(caps, events, False, i)
    assert failure_off is not None and failure_off[:3] == ("violation", i, "BlockPool")
    assert failure_on == failure_off and on == off


def test_int_rows_passes_exact_int_rows_and_converts_anything_else() -> None:
    import numpy as np

    from atlas.state.events import int_rows

    rows = ((1, 2), (3, 4, 5))
    assert int_rows(rows) is rows  # the scheduler's rows: no tuple built
    for value in (((1, np.int64(2)),), [[1, 2]], ((True, 2),), ([1, 2],), ((1,), [2])):
        out = int_rows(value)
        assert out == tuple(tuple(int(b) for b in row) for row in value)
        assert type(out) is tuple and all(type(r) is tuple and all(type(b) is int for b in r) for r in out)


# ------------------------------------------------------------------------------ the batch's cursor check, per field


class _Skewed:
    """Delegates to a backend; at one decode step reports one field of one row's cursors one off."""

    def __init__(self, inner: object, field: str, at_step: int, row: int) -> None:
        self.inner, self.field, self.at_step, self.row = inner, field, at_step, row

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def execute(self, plan):  # type: ignore[no-untyped-def]
        result = self.inner.execute(plan)
        if plan.step != self.at_step:
            return result
        outs = list(result.outcomes)
        o = outs[self.row]
        cur = attrs.evolve(o.cursors, **{self.field: getattr(o.cursors, self.field) + 1})
        outs[self.row] = attrs.evolve(o, cursors=cur)
        return attrs.evolve(result, outcomes=tuple(outs))


def _skewed_run(field: str, columns: bool) -> tuple[str, str, dict, int]:
    config, n = _ALIGNED
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=RecordingSink())
    engine.state.batch_cache = columns
    engine.backend = _Skewed(engine.backend, field, 6, 13)  # type: ignore[assignment]
    for i in range(n):
        engine.add_request(f"r{i}", [(i * 3 + k) % 150 + 1 for k in range(7)],
                           SamplingParams(max_tokens=30, temperature=0.7, seed=i, ignore_eos=True))
    saw_columns = False
    with pytest.raises(InvariantViolation) as caught:
        while engine.has_unfinished():
            saw_columns |= engine.state.step == 6 and engine.state.batch is not None
            engine.step()
    assert saw_columns == columns  # the skewed step ran on the batch columns (on) or the objects (off)
    v = caught.value
    return v.machine, v.message, v.fields, v.event_index


@pytest.mark.parametrize("field", ["kv_tokens", "qsa_ingested", "ssm_position", "ple_position", "drafter_rows"])
def test_each_cursor_field_one_off_is_named_as_without_columns(field: str) -> None:
    on = _skewed_run(field, True)
    assert on[0] == "BackendCursors" and on[2]["step"] == 6
    assert on == _skewed_run(field, False)

