"""The engine's steady decode step (docs/CONTROL-PLANE.md, eighth pass): `planner.steady_decode` decides a decode of the
batch columns' rows without `schedule`'s generator and `batch`. Whenever it decides, its StepPlanned is the one event
`schedule` yields from the same state; runs with it on and off record the same events, digests and outputs. Workloads
with short rows (a block allocated in the step), finishes, a waiting queue (admissions), a pool small enough to
preempt, and a step that releases finished sequences."""

from __future__ import annotations

import pytest

from atlas.config import EngineConfig
from atlas.engine import engine as engine_module
from atlas.engine import planner
from atlas.engine.records import RecordingSink
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams

_REAL = planner.steady_decode

WORKLOADS = {
    # 20 rows, blocks of 8: every 8th step allocates for every row; budgets differ, so rows finish one by one
    "finishes": (EngineConfig(max_seq_len=96, max_batch_size=24, prefill_chunk_tokens=200, block_size=8),
                 20, lambda i: 20 + i % 7),
    # more requests than batch slots: waiting sequences are admitted as rows finish
    # (one row finishes a step, so the columns keep > 16 rows and a steady step sees the waiting queue and a slot)
    "waiting": (EngineConfig(max_seq_len=96, max_batch_size=20, prefill_chunk_tokens=400, block_size=8),
                28, lambda i: 10 + i),
    # a pool too small for every row's growth: batch preempts, steady_decode must stand aside then
    "preempt": (EngineConfig(max_seq_len=96, max_batch_size=20, prefill_chunk_tokens=200, block_size=8,
                             num_kv_blocks=70), 20, lambda i: 40 + i % 3),
}


def _run(name: str, steady: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, list[tuple]]:
    config, n, budget = WORKLOADS[name]
    decided: list[tuple] = []  # (steady's event, schedule's events) of every step steady_decode decided

    def checked(state, lanes):  # type: ignore[no-untyped-def]
        e = _REAL(state, lanes)
        if e is not None:
            decided.append((e, list(planner.schedule(state, lanes))))  # schedule is pure: reads the state only
        return e if steady else None

    monkeypatch.setattr(engine_module, "steady_decode", checked)
    sink = RecordingSink()
    engine = build_engine("atlas-tiny", backend="null", config=config, sink=sink)
    for i in range(n):
        engine.add_request(f"r{i}", [(i * 7 + k) % 150 + 1 for k in range(5 + i % 6)],
                           SamplingParams(max_tokens=budget(i), temperature=0.7, seed=i, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    engine.close()
    return [(i, s, e, d) for i, s, e, d in sink.rows], outputs, decided


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_steady_decode_is_schedules_step_and_changes_no_event(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rows_on, out_on, decided = _run(name, True, monkeypatch)
    rows_off, out_off, _ = _run(name, False, monkeypatch)
    assert rows_on == rows_off and out_on == out_off  # same events, payloads, steps and digests; same outputs
    assert len(decided) >= 10
    for e, scheduled in decided:
        assert scheduled == [e]
    assert any(e.alloc for e, _ in decided)  # short rows took their blocks in the fused step
    if name == "finishes":
        assert any(e.release for e, _ in decided)  # a finished row's release carried by a steady step


def test_steady_decode_stands_aside_when_batch_would_preempt_or_admit(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, field in (("preempt", "reset"), ("waiting", "admitted")):
        rows, _, decided = _run(name, True, monkeypatch)
        planned = [e for _, _, e, _ in rows if type(e).__name__ == "StepPlanned"]
        assert any(getattr(e, field) for e in planned)  # the workload preempts / admits (through schedule)
        assert not any(e.reset or e.admitted for e, _ in decided)
