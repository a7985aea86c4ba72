"""Rollback end to end in the engine, on the CPU backend and atlas-tiny whose sampler is scripted to loop
(LoopingBackend: every cursor, snapshot and restore is the real data plane's; only the sampled ids are
forced). A loop in a non-streaming request is rolled back in one event and re-steered; what cannot be made
exact declines with a typed reason and ends the request with `stop`."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from atlas.backends.cpu import CpuBackend
from atlas.config import EngineConfig, derive_capacities
from atlas.engine.engine import Engine
from atlas.engine.outputs import FinishReason, RequestOutput
from atlas.engine.records import RecordingSink
from atlas.engine.watchdog import WatchdogConfig, detect_loop
from atlas.model import load_model
from atlas.plan import StepPlan, StepResult
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.events import BoundarySnapshotted, RequestFinished, RollbackDeclined, RolledBack, StepPlanned
from atlas.state.invariants import audit

PROMPT = list(b"Loop test: ")  # 11 tokens
PATTERN = tuple(b"abcd")


class LoopingBackend:
    """The CPU backend, with its sampled ids replaced from `after` generated tokens on by `pattern` repeated:
    a model caught in a content loop. A position where a rollback banned the scripted id gets the model's
    own re-steered sample; `relapse` says whether the loop then comes back at the next position."""

    def __init__(self, inner: CpuBackend, prompt_len: int, pattern: tuple[int, ...] = PATTERN, after: int = 6,
                 relapse: bool = False) -> None:
        self.inner, self.name = inner, "cpu-looping"
        self.prompt_len, self.pattern, self.after, self.relapse = prompt_len, pattern, after, relapse
        self.steered: set[int] = set()

    def execute(self, plan: StepPlan) -> StepResult:
        result = self.inner.execute(plan)
        outcomes = []
        for work, o in zip(plan.work, result.outcomes, strict=True):
            g = work.end - self.prompt_len  # the index of the generated token being sampled
            if o.token is not None and g >= self.after and work.seq_id not in self.steered:
                scripted = self.pattern[(g - self.after) % len(self.pattern)]
                if scripted in work.banned:
                    assert o.token not in work.banned  # the data plane honoured the ban
                    if not self.relapse:
                        self.steered.add(work.seq_id)
                else:
                    o = attrs.evolve(o, token=scripted)
            outcomes.append(o)
        return attrs.evolve(result, outcomes=tuple(outcomes))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


def config(**overrides: Any) -> EngineConfig:
    base = dict(max_seq_len=160, max_batch_size=2, prefill_chunk_tokens=32, loop_watchdog=True, ring_slots=4,
                snapshot_interval=8, watchdog_max_period=8, watchdog_min_repeats=4, watchdog_min_span=24,
                watchdog_window=64, max_rollbacks=2)
    return EngineConfig(**{**base, **overrides})


def looping_engine(tiny, cfg: EngineConfig, **script: Any) -> Engine:
    caps = derive_capacities(cfg, tiny.spec, activation_bytes=4)
    inner = CpuBackend(tiny, num_kv_blocks=caps.num_kv_blocks, block_size=caps.block_size, ring_slots=caps.ring_slots)
    return Engine(LoopingBackend(inner, len(PROMPT), **script), tokenizer=tiny.tokenizer, config=cfg,
                  capacities=caps, spec=tiny.spec, sink=RecordingSink(), full_audit=True)


def run(engine: Engine, requests: dict[str, bool], max_tokens: int = 60) -> dict[str, list[RequestOutput]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, stream in requests.items():
        engine.add_request(rid, PROMPT, params, stream=stream)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    audit(engine.state, -1)
    return outputs


def events(engine: Engine, kind: type) -> list[Any]:
    return [e for _, _, e, _ in engine.sink.rows if isinstance(e, kind)]  # type: ignore[union-attr]


def test_a_looping_request_is_rolled_back_once_and_completes(tiny) -> None:
    engine = looping_engine(tiny, config())
    outs = run(engine, {"held": False})["held"]
    assert len(outs) == 1 and outs[0].finished  # held back: one output with the whole completion
    out = outs[0]
    assert out.finish_reason is FinishReason.LENGTH and len(out.new_token_ids) == 60
    (rb,) = events(engine, RolledBack)
    assert rb.attempt == 1 and rb.period == len(PATTERN) and not events(engine, RollbackDeclined)
    keep = rb.keep - len(PROMPT)
    assert keep == 6 + len(PATTERN)  # the first copy of the loop is kept, the second one is where it re-steers
    assert out.new_token_ids[6:keep] == PATTERN and out.new_token_ids[keep] != rb.ban_token == PATTERN[0]
    rows = [e for _, _, e, _ in engine.sink.rows]  # type: ignore[union-attr]
    after = rows[rows.index(rb) + 1:]
    plan = next(e for e in after if isinstance(e, StepPlanned))
    assert plan.restored == (rb.seq_id,)  # the data plane's restore is the next plan's order
    assert len(PROMPT) <= rb.boundary < rb.keep
    assert detect_loop(out.new_token_ids, WatchdogConfig(8, 4, 24, 64)) is None
    snaps = events(engine, BoundarySnapshotted)
    assert {s.position for s in snaps} >= {len(PROMPT), len(PROMPT) + 8}
    assert all((s.position - len(PROMPT)) % 8 == 0 for s in snaps)
    assert out.new_text == tiny.tokenizer.decode(list(out.new_token_ids))
    assert engine.stats().rollbacks_total == 1 and engine.stats().rollback_declines_total == 0


def test_the_rolled_back_run_is_deterministic_event_for_event(tiny) -> None:
    traces = []
    for _ in range(2):
        engine = looping_engine(tiny, config())
        run(engine, {"a": False, "b": False}, max_tokens=50)
        traces.append([(e.kind, e.payload(), digest) for _, _, e, digest in engine.sink.rows])  # type: ignore[union-attr]
    assert traces[0] == traces[1]
    assert sum(kind == "rolled_back" for kind, _, _ in traces[0]) == 2


@pytest.mark.parametrize("overrides, stream, script, reason", [
    ({}, True, {}, "streamed"),
    ({"ring_slots": 0}, False, {}, "ring_disabled"),
    ({"ring_slots": 1}, False, {}, "no_snapshot"),  # the one slot holds only a boundary past the loop's start
    ({"max_rollbacks": 1}, False, {"relapse": True}, "attempts_exhausted"),
])
def test_a_rollback_that_cannot_be_exact_declines_and_stops(tiny, overrides: dict, stream: bool, script: dict,
                                                            reason: str) -> None:
    engine = looping_engine(tiny, config(**overrides), **script)
    outs = run(engine, {"r": stream})["r"]
    (declined,) = events(engine, RollbackDeclined)
    assert declined.reason == reason
    final = outs[-1]
    assert final.finished and final.finish_reason is FinishReason.STOP and reason in final.finish_detail
    (finished,) = events(engine, RequestFinished)
    assert finished.reason == "stop" and reason in finished.detail
    assert len(events(engine, RolledBack)) == (1 if reason == "attempts_exhausted" else 0)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(outs) == (len(tokens) if stream else 1)  # streamed per token, or held back whole
    assert detect_loop(tokens, WatchdogConfig(8, 4, 24, 64)) is not None  # it stopped in the loop


def test_a_decline_mutates_nothing(tiny) -> None:
    engine = looping_engine(tiny, config(ring_slots=0))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=60, ignore_eos=True))
    while not events(engine, RollbackDeclined):
        engine.step()
    rows = engine.sink.rows  # type: ignore[union-attr]
    i = next(k for k, row in enumerate(rows) if isinstance(row[2], RollbackDeclined))
    assert rows[i][3] == rows[i - 1][3]  # the digest after the decline is the digest before it
    assert isinstance(rows[i + 1][2], RequestFinished)


def test_without_the_watchdog_the_loop_runs_to_length(tiny) -> None:
    engine = looping_engine(tiny, config(loop_watchdog=False))
    out = run(engine, {"r": False})["r"][0]
    assert out.finish_reason is FinishReason.LENGTH and out.new_token_ids[6:] == (PATTERN * 14)[:54]
    assert not events(engine, RolledBack) and not events(engine, RollbackDeclined)


def test_a_traced_run_with_the_ring_and_watchdog_on_replays(tiny, tmp_path) -> None:
    from atlas.replay.reader import TraceReader
    from atlas.replay.verify import verify

    trace = tmp_path / "ring.sqlite"
    engine = build_engine("atlas-tiny", "cpu", config(), loaded=tiny, trace=str(trace))
    run(engine, {"a": False, "b": True}, max_tokens=20)
    engine.close()
    reader = TraceReader(trace)
    try:
        kinds = [e.kind for e in reader.events(reader.run().run_id)]
    finally:
        reader.close()
    assert kinds.count("boundary_snapshotted") >= 4
    report = verify(trace)
    assert report.identical, report.divergence.describe()
    assert report.events_replayed == len(kinds)
