"""A traced CPU run with prefix caching, the drafter carry and MTP speculation, in a pool tight enough that a
warm turn sharing cached blocks is preempted and resumes from the cache again: tokens equal cold runs, the
trace replays event for event, passes the state-only audit, and `atlas trace show` reports the hits."""

from __future__ import annotations

from pathlib import Path

import torch
from typer.testing import CliRunner

from atlas.cli import app
from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.replay.reader import TraceReader
from atlas.replay.summary import summarize
from atlas.replay.verify import check_state_only, verify
from atlas.sampling.params import SamplingParams
from atlas.state.invariants import audit

torch.set_num_threads(1)
TINY = load_model("atlas-tiny")
# 18 blocks of 4 (one sequence of 64 needs 16): a warm turn and an unrelated long one cannot both finish
CONFIG = EngineConfig(max_seq_len=64, max_batch_size=2, prefill_chunk_tokens=16, block_size=4, num_kv_blocks=18,
                      enable_prefix_caching=True, prefix_snapshots=4, num_drafts=2, drafter="mtp")


def drive(engine: Engine, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for rid, prompt, n in requests:
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n))
        got[rid] = []
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
    return got


def cold(prompt: list[int], n: int) -> list[int]:
    engine = build_engine("atlas-tiny", "cpu", EngineConfig(max_seq_len=64, block_size=4, max_batch_size=2,
                                                             prefill_chunk_tokens=16), loaded=TINY)
    return drive(engine, [("c", prompt, n)])["c"]


def test_traced_multiturn_run_with_preemption_replays(tmp_path: Path) -> None:
    path = tmp_path / "prefix.db"
    engine = build_engine("atlas-tiny", "cpu", CONFIG, loaded=TINY, trace=str(path), full_audit=True)
    first = list(range(30, 60))
    a1 = drive(engine, [("a1", first, 6)])["a1"]
    second = first + a1[:-1] + [7, 8, 9]
    other = list(range(100, 130))
    got = drive(engine, [("b1", other, 30), ("a2", second, 20)])
    assert got["a2"] == cold(second, 20) and got["b1"] == cold(other, 30) and a1 == cold(first, 6)
    audit(engine.state, -1)
    assert engine.state.pool.used == 0 and not engine.state.seqs
    engine.close()

    kinds = [e.kind for e in TraceReader(path).events(1)]
    for kind in ("prefix_cache_hit", "prefix_snapshotted", "carry_stored", "carry_adopted", "sequence_preempted"):
        assert kind in kinds, kind
    assert kinds.count("prefix_cache_hit") >= 2  # a2 hit, was preempted, and hit again
    report = verify(path)
    assert report.identical, report.divergence and report.divergence.describe()
    assert check_state_only(path).problem is None

    summary = summarize(path)
    assert summary.prefix is not None and summary.prefix["hits"] == kinds.count("prefix_cache_hit")
    shown = CliRunner().invoke(app, ["trace", "show", str(path)])
    assert shown.exit_code == 0 and "prefix cache:" in shown.output and "a2: resumed at" in shown.output
