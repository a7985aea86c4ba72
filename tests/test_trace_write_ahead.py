"""The write-ahead trace: every output a client received is backed by events on disk, a run that did not end
cleanly reads as truncated (never "identical" or "consistent" silently), and the metric counts persisted events."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from atlas.cli import app
from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.engine.offline import generate
from atlas.registry import build_engine
from atlas.replay.jsonl import export_jsonl, import_jsonl
from atlas.replay.reader import TraceReader
from atlas.replay.store import TraceWriteError, TraceWriter
from atlas.replay.summary import run_end, summarize
from atlas.sampling.params import SamplingParams
from atlas.server.metrics import sample_value
from atlas.server.serve import serve_in_thread
from atlas.state.events import FaultInjected

runner = CliRunner()
RUN = {"engine_version": "t", "git_revision": None, "model": "m", "model_fingerprint": "f", "backend": "null",
       "seed": None, "config": {}, "capacities": {}}


def _null(trace: Path | None = None, **config: int) -> Engine:
    return build_engine("atlas-tiny", "null", trace=None if trace is None else str(trace),
                             config=EngineConfig(**{"max_seq_len": 256, **config}))


def _run_some(engine: Engine, n: int = 3) -> None:
    generate(engine, [[65 + i] * 5 for i in range(n)], SamplingParams(max_tokens=6, ignore_eos=True))


def test_a_clean_run_ends_with_its_marker_and_a_killed_one_reads_truncated(tmp_path: Path) -> None:
    clean, killed = tmp_path / "clean.db", tmp_path / "killed.db"
    engine = _null(clean)
    _run_some(engine)
    engine.close()
    end = run_end(clean)
    assert end.status == "ended" and not end.truncated and end.events == TraceReader(clean).count_events(1)

    engine = _null(killed)
    _run_some(engine)
    engine.trace_sink.commit()  # what the server does after every step; then the process dies: no close
    end = run_end(killed)
    assert end.truncated and end.last_index == end.events - 1
    assert "TRUNCATED" in end.describe() and f"event {end.last_index}" in end.describe()

    for command, word in ((["trace", "show"], "events over"), (["replay", "check"], "consistent"),
                          (["replay", "verify"], "replay identically")):
        ok = runner.invoke(app, [*command, str(clean)])
        assert ok.exit_code == 0 and "TRUNCATED" not in ok.output, ok.output
        cut = runner.invoke(app, [*command, str(killed)])
        assert "TRUNCATED" in cut.output and word in cut.output, cut.output
        assert cut.exit_code == (0 if command[0] == "trace" else 1), cut.output
    assert summarize(killed).end.truncated


def test_a_trace_recorded_before_markers_is_not_called_truncated(tmp_path: Path) -> None:
    trace = tmp_path / "old.db"
    engine = _null(trace)
    _run_some(engine)
    engine.close()
    con = sqlite3.connect(trace)
    con.execute("delete from run_status")
    con.commit()
    con.close()
    assert run_end(trace).status == "unmarked"
    verified = runner.invoke(app, ["replay", "verify", str(trace)])
    assert verified.exit_code == 0 and "identical" in verified.output


def test_the_marker_travels_through_json_lines(tmp_path: Path) -> None:
    trace = tmp_path / "killed.db"
    engine = _null(trace)
    _run_some(engine)
    engine.trace_sink.commit()
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    export_jsonl(trace, first)
    assert json.loads(first.read_text().splitlines()[0])["end"] == {"ended": False}
    imported = tmp_path / "imported.db"
    import_jsonl(first, imported)
    assert run_end(imported).truncated
    export_jsonl(imported, second)
    assert first.read_bytes() == second.read_bytes()


def test_async_commits_land_in_order_and_report_only_once_on_disk(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / "w.db", run=RUN)
    seen: list[tuple[int, int]] = []
    done = threading.Event()
    for batch in range(20):
        for i in range(3):
            writer.append(3 * batch + i, batch, FaultInjected("step_error", None), "d")

        def committed(error: BaseException | None, batch: int = batch) -> None:
            assert error is None
            con = sqlite3.connect(tmp_path / "w.db")  # another connection sees them: they are committed
            seen.append((batch, con.execute("select count(*) from events").fetchone()[0]))
            con.close()
            if batch == 19:
                done.set()

        writer.commit_async(committed)
    assert done.wait(10)
    assert [b for b, _ in seen] == list(range(20))  # in order; batches queued meanwhile commit together
    assert all(on_disk >= 3 * (b + 1) for b, on_disk in seen), seen
    assert writer.events_written == 60
    writer.close()
    assert run_end(tmp_path / "w.db").status == "ended"


def test_a_full_disk_fails_every_later_commit_and_close_says_so(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / "full.db", run=RUN)
    writer.append(0, 0, FaultInjected("step_error", None), "d")
    writer.commit()
    writer.inject_full_disk()
    with pytest.raises(TraceWriteError, match="full"):
        for i in range(1, 5000):  # until a commit needs a page the store may not have
            writer.append(i, i, FaultInjected("step_error", "x" * 200), "d")
            writer.commit()
    with pytest.raises(TraceWriteError):
        writer.commit()
    with pytest.raises(TraceWriteError):
        writer.close()
    assert run_end(tmp_path / "full.db").truncated  # the marker never claims an end the disk did not see


def _request_on_disk(trace: Path, request_id: str) -> dict:
    summary = summarize(trace)
    return next(({"tokens": r.completion_tokens, "finish": r.finish_reason} for r in summary.requests
                 if r.request_id == request_id), {})


@pytest.mark.parametrize("commit", ["thread", "inline"])
def test_every_output_a_client_received_is_already_on_disk(tmp_path: Path, commit: str) -> None:
    trace = tmp_path / "served.db"
    engine = _null(trace)
    with serve_in_thread(engine) as served, httpx.Client(base_url=served.url, timeout=30) as http:
        served.engine_loop.commit_mode = commit  # type: ignore[assignment]
        for i in range(3):
            r = http.post("/v1/completions", json={"prompt": f"whole {i}", "max_tokens": 5 + i, "ignore_eos": True})
            assert r.status_code == 200
            assert _request_on_disk(trace, r.headers["x-request-id"]) == {"tokens": 5 + i, "finish": "length"}
        body = {"prompt": "streamed", "max_tokens": 12, "ignore_eos": True, "stream": True, "logprobs": 0}
        with http.stream("POST", "/v1/completions", json=body) as r:
            request_id = r.headers["x-request-id"]
            received = 0
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                received += len((choice.get("logprobs") or {}).get("tokens") or [])
                on_disk = _request_on_disk(trace, request_id)
                assert on_disk and on_disk["tokens"] >= received, (received, on_disk)
        assert received == 12
        http.get("/health")
        registry = served.app.state.metrics.registry
        written = sample_value(registry, "atlas:trace_events_written_total", {"model_name": "atlas-tiny"})
        with sqlite3.connect(trace) as con:
            assert written == con.execute("select count(*) from events").fetchone()[0]
