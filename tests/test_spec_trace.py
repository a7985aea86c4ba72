"""Speculative decoding in the trace: acceptance statistics derived from the events alone equal the engine's,
`atlas trace show` prints them, and a speculative run replays (verify) and state-checks."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from atlas.cli import app
from atlas.config import EngineConfig
from atlas.engine.offline import generate
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.replay.summary import summarize
from atlas.replay.verify import verify
from atlas.sampling.params import SamplingParams


def test_acceptance_statistics_come_from_the_trace_and_the_run_replays(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    trace = str(tmp_path / "spec.db")
    config = EngineConfig(max_seq_len=96, max_batch_size=2, prefill_chunk_tokens=32, num_drafts=3, drafter="ngram")
    engine = build_engine("atlas-tiny", "cpu", config, loaded=load_model("atlas-tiny"), trace=trace)
    prompts = [list(b"one two three, one two three, one two three, one two"), list(b"abcabcabcabcab")]
    params = [SamplingParams(max_tokens=24, ignore_eos=True), SamplingParams(max_tokens=20, temperature=0.8, seed=1)]
    results = generate(engine, prompts, params)
    stats = engine.stats()
    engine.close()
    assert stats.spec_verify_steps > 0
    s = summarize(trace)
    assert s.speculation is not None
    assert s.speculation["verify_steps"] == stats.spec_verify_steps
    assert s.speculation["drafts_accepted"] == stats.spec_drafts_accepted
    assert s.speculation["p_unconditional"] == [round(p, 4) for p in stats.spec_acceptance_unconditional]
    assert [q.completion_tokens for q in s.requests] == [len(r.token_ids) for r in results]
    assert verify(trace).identical
    shown = CliRunner().invoke(app, ["trace", "show", trace])
    assert shown.exit_code == 0 and "tokens per verify" in shown.output
