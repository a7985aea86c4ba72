"""A trace records its backend's options (the state-digest audit included) and replay rebuilds the backend with
them, for every backend: the failure library's scenario backends run the audit on replay as the CPU backend does,
and an option that changes the engine's decisions (per_row_qsa_verify=False: the QSA latch) replays as recorded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atlas.config import EngineConfig
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.registry import build_engine, engine_for_run
from atlas.replay.reader import TraceReader
from atlas.replay.verify import verify
from atlas.sampling.params import SamplingParams

torch.set_num_threads(1)
TINY = load_model("atlas-tiny")
CONFIG = EngineConfig(max_seq_len=40, max_batch_size=2, prefill_chunk_tokens=16, block_size=4, num_kv_blocks=24,
                      ring_slots=2, snapshot_interval=4)


def record(path: Path, backend: str, config: EngineConfig = CONFIG, options: dict | None = None) -> None:
    engine = build_engine("atlas-tiny", backend, config, trace=str(path), loaded=TINY, backend_options=options)
    try:
        engine.add_request("a", list(b"the scenario trace"), SamplingParams(max_tokens=8, ignore_eos=True))
        engine.add_request("b", list(b"two"), SamplingParams(max_tokens=6, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.close()


def run_of(path: Path):  # type: ignore[no-untyped-def]
    reader = TraceReader(str(path))
    try:
        return reader.run()
    finally:
        reader.close()


@pytest.mark.parametrize("backend", ["cpu", "cpu-looping", "cpu-row-blind"])
def test_a_scenario_trace_replays_with_the_state_audit(tmp_path: Path, backend: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATLAS_STATE_AUDIT", raising=False)  # the audit comes from the trace, not the environment
    record(tmp_path / "t.db", backend)
    run = run_of(tmp_path / "t.db")
    assert run.config["backend_options"] == {"state_audit": False}  # recorded as it ran
    engine = engine_for_run(run, RecordingSink(), loaded=TINY)
    assert engine.backend.store.audit is not None  # replay audits (the scenario backends dropped it before)
    engine.close()
    assert verify(tmp_path / "t.db", engine_kwargs={"loaded": TINY}).divergence is None


def test_the_recorded_options_are_restored_and_the_callers_win(tmp_path: Path) -> None:
    config = EngineConfig(max_seq_len=40, max_batch_size=2, num_drafts=2, drafter="ngram")
    record(tmp_path / "t.db", "cpu", config, {"per_row_qsa_verify": False, "state_audit": True})
    run = run_of(tmp_path / "t.db")
    assert run.config["backend_options"] == {"per_row_qsa_verify": False, "state_audit": True}
    replayed = engine_for_run(run, RecordingSink(), loaded=TINY)
    assert replayed.lanes.spec is not None and replayed.lanes.spec.bound == TINY.spec.qsa.inert_bound
    told = engine_for_run(run, RecordingSink(), loaded=TINY, backend_options={"per_row_qsa_verify": True})
    assert told.lanes.spec is not None and told.lanes.spec.bound is None
    assert verify(tmp_path / "t.db", engine_kwargs={"loaded": TINY}).divergence is None
