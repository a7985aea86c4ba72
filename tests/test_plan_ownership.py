"""Who owns a plan (atlas.plan): the engine lends each StepPlan to the backend for its step and moves a decode's
SeqWork objects to the next step in place (BatchColumns.decode_work), unless the backend declares `retains_plans`.

- A backend that keeps every plan and declares it gets fresh work each step, and every plan it kept still holds
  what it held at execute after the run; a backend that keeps none is handed one tuple moved step by step; both
  runs give the same plans (as values), the same trace (events and digests) and the same outputs.
- Events carry nothing the engine moves: every event a sink kept reads the same after the run as when appended.
- The repository's backends keep no reference to a plan or its work past execute (null, the CPU reference, the
  CUDA backend on the CPU path with its steady decode step; on a GPU with `-m cuda`): with `retains_plans`
  declared by the checking wrapper every plan's work is new, so any reference a backend kept shows in the counts.
"""

from __future__ import annotations

import sys

import pytest
import torch

from atlas.config import EngineConfig
from atlas.engine.offline import generate
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.events import Event

CONFIG = EngineConfig(max_seq_len=96, max_batch_size=20, prefill_chunk_tokens=200, block_size=8)


def _row(w):  # type: ignore[no-untyped-def]
    return (w.seq_id, w.tokens, w.start, w.block_table, w.sample, w.sampling)


class _Watching:
    """Delegates to a backend; notes each plan's work as values, and with `retains_plans` keeps every plan."""

    def __init__(self, inner: object, retains: bool) -> None:
        self.inner = inner
        self.retains_plans = retains
        self.kept: list[tuple[object, tuple]] = []
        self.seen: list[tuple] = []
        self.ids: list[int] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def execute(self, plan):  # type: ignore[no-untyped-def]
        self.seen.append(tuple(map(_row, plan.work)))
        self.ids.append(id(plan.work))
        if self.retains_plans:
            self.kept.append((plan, self.seen[-1]))
        return self.inner.execute(plan)


class _SnapshotSink(RecordingSink):
    """A RecordingSink that also notes each event's repr as it is appended."""

    def __init__(self) -> None:
        super().__init__()
        self.when: list[str] = []

    def append(self, index: int, step: int, e: Event, digest: str) -> None:
        super().append(index, step, e, digest)
        self.when.append(repr(e))


def _decode_run(retains: bool) -> tuple[_Watching, _SnapshotSink, list]:
    sink = _SnapshotSink()
    engine = build_engine("atlas-tiny", backend="null", config=CONFIG, sink=sink)
    watching = _Watching(engine.backend, retains)
    engine.backend = watching  # type: ignore[assignment]
    for i in range(18):
        engine.add_request(f"r{i}", [(i * 5 + k) % 150 + 1 for k in range(6 + i % 5)],
                           SamplingParams(max_tokens=20 + i % 4, temperature=0.7, seed=i, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    engine.close()
    return watching, sink, outputs


def test_a_retaining_backend_gets_fresh_work_and_the_same_trace() -> None:
    lent, lent_sink, lent_out = _decode_run(False)
    kept, kept_sink, kept_out = _decode_run(True)
    assert lent.seen == kept.seen and lent_out == kept_out
    assert lent_sink.rows == kept_sink.rows  # every event and digest
    # lent: the decode steps of one batch were handed one tuple, moved step by step
    assert len(lent.ids) - len(set(lent.ids)) >= 10
    # kept: every plan alive (so no id repeats) and each still what it was at its execute
    assert len(kept.ids) == len(set(kept.ids))
    for plan, seen in kept.kept:
        assert tuple(map(_row, plan.work)) == seen  # type: ignore[attr-defined]


def test_recorded_events_never_change_after_they_are_appended() -> None:
    _, sink, _ = _decode_run(False)
    assert len(sink.rows) > 60
    assert [repr(e) for _, _, e, _ in sink.rows] == sink.when


class _Checking:
    """Declares `retains_plans` (so every plan's work is new) and checks the inner backend kept no reference to the
    plan, its work tuple or any SeqWork in it (strong or weak) once execute returned."""

    retains_plans = True

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.checked = 0
        self.kept: list[tuple] = []  # (step, counts before execute, after) where a reference stayed

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def execute(self, plan):  # type: ignore[no-untyped-def]
        import weakref

        work = plan.work
        before = (sys.getrefcount(plan), sys.getrefcount(work), [sys.getrefcount(w) for w in work],
                  [weakref.getweakrefcount(w) for w in work])
        result = self.inner.execute(plan)
        after = (sys.getrefcount(plan), sys.getrefcount(work), [sys.getrefcount(w) for w in work],
                 [weakref.getweakrefcount(w) for w in work])
        if after != before:  # (noted: the engine would take a raise here for a failed step)
            self.kept.append((plan.step, before, after))
        self.checked += len(work)
        return result


def _checked_run(backend: str, **options: object) -> tuple[_Checking, object]:
    loaded = None if backend == "null" else load_model("atlas-tiny")
    config = EngineConfig(max_seq_len=96, max_batch_size=3, prefill_chunk_tokens=16)
    engine = build_engine("atlas-tiny", backend, config, loaded=loaded, sink=RecordingSink(),
                          **({"backend_options": options} if options else {}))
    checking = _Checking(engine.backend)
    engine.backend = checking  # type: ignore[assignment]
    params = [SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=30, ignore_eos=True)]
    generate(engine, [list(b"hello"), list(b"a longer prompt here"), [1, 2]], params)
    inner = checking.inner
    engine.close()
    return checking, inner


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's reference counts")
@pytest.mark.parametrize("backend", ["null", "cpu"])
def test_the_backends_keep_no_plan_past_execute(backend: str) -> None:
    checking, _ = _checked_run(backend)
    assert checking.checked > 40 and not checking.kept


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's reference counts")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")])])
def test_the_cuda_backend_keeps_no_plan_past_execute(device: str) -> None:
    """The CUDA backend, its steady decode step included (it keeps the last rows' ids, tables and params: values)."""
    options: dict[str, object] = {"device": "cpu", "cuda_graphs": False} if device == "cpu" else {}
    checking, inner = _checked_run("cuda-fp32", **options)
    assert checking.checked > 40 and not checking.kept
    assert inner.steady.steps > 20  # type: ignore[attr-defined]
