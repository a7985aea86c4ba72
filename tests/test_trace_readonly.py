"""A reader never writes, and a run that lost its last events is never read as clean.

`trace show`, `trace export`, `replay check` and `replay verify` leave a trace's database, -wal and -shm byte for byte
as they found them: a run that ended (no -wal: read `immutable`), a writer killed mid-run (-wal and -shm left: the
-wal read through a read-only -shm), and a -wal whose -shm is gone (read from a temporary copy). The run-end
marker's event count is checked against the events on disk.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from atlas.cli import run as atlas_run
from atlas.replay.reader import TraceReader

KILLED = """
import os, sys
from atlas.config import EngineConfig
from atlas.engine.offline import generate
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams

engine = build_engine("atlas-tiny", "cpu", EngineConfig(max_seq_len=64, max_batch_size=2), trace=sys.argv[1])
generate(engine, [[104, 105], [97, 98, 99]], SamplingParams(max_tokens=3))
engine.journal.flush()  # every event committed, then killed: no run-end marker, the -wal and -shm left behind
os._exit(0)
"""


def _files(trace: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(trace.parent.glob(trace.name + "*"))}


def _read_all(capsys: pytest.CaptureFixture[str], trace: Path, *, verify: bool) -> list[tuple[int, str]]:
    seen = []
    argvs = [["trace", "show", str(trace)], ["replay", "check", str(trace)],
             ["trace", "export", str(trace), "-o", str(trace.with_name("out.jsonl"))]]
    for argv in argvs + ([["replay", "verify", str(trace)]] if verify else []):
        code = atlas_run(argv)
        seen.append((code, capsys.readouterr().out))
    reader = TraceReader(trace)  # the library's reader too, left open while the CLI read
    assert reader.end(reader.run().run_id).events > 0
    reader.close()
    return seen


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    trace = tmp_path_factory.mktemp("killed") / "run.db"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", KILLED, str(trace)], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr
    assert Path(f"{trace}-wal").stat().st_size > 0 and Path(f"{trace}-shm").exists()
    return trace


def test_readers_leave_a_killed_writers_files_byte_identical(capsys, killed: Path) -> None:
    before = _files(killed)
    assert set(before) == {"run.db", "run.db-wal", "run.db-shm"}
    seen = _read_all(capsys, killed, verify=True)
    assert _files(killed) == before
    # the -wal's events were read (the database file alone holds none of them): a truncated run, said so
    assert "TRUNCATED" in seen[0][1] and seen[1][0] == 1 and "TRUNCATED" in seen[1][1] and seen[3][0] == 1
    assert seen[2][0] == 0


def test_a_wal_without_its_shm_is_read_from_a_copy(capsys, killed: Path, tmp_path: Path) -> None:
    trace = tmp_path / "run.db"
    for suffix in ("", "-wal"):
        trace.with_name("run.db" + suffix).write_bytes(Path(f"{killed}{suffix}").read_bytes())
    before = _files(trace)
    seen = _read_all(capsys, trace, verify=False)
    assert _files(trace) == before and set(before) == {"run.db", "run.db-wal"}
    assert seen[1][0] == 1 and "TRUNCATED" in seen[1][1]


def test_readers_leave_an_ended_trace_byte_identical(capsys, tmp_path: Path) -> None:
    trace = tmp_path / "run.db"
    assert atlas_run(["generate", "--prompt", "hi", "--max-tokens", "3", "--max-seq-len", "64",
                      "--trace", str(trace)]) == 0
    capsys.readouterr()
    before = _files(trace)
    assert set(before) == {"run.db"}
    seen = _read_all(capsys, trace, verify=True)
    assert _files(trace) == before  # no -wal or -shm created, nothing checkpointed
    assert [code for code, _ in seen] == [0, 0, 0, 0]


def test_a_run_that_lost_its_last_events_fails_the_check(capsys, tmp_path: Path) -> None:
    trace = tmp_path / "run.db"
    assert atlas_run(["generate", "--prompt", "hello", "--max-tokens", "4", "--max-seq-len", "64",
                      "--trace", str(trace)]) == 0
    capsys.readouterr()
    con = sqlite3.connect(trace)
    total = con.execute("SELECT count(*) FROM events").fetchone()[0]
    assert con.execute("SELECT events, ended FROM run_status").fetchone() == (total, 1)
    for lost in (1, 2):  # the last event, then the one before it too: what is left replays consistently
        con.execute("DELETE FROM events WHERE idx = (SELECT max(idx) FROM events)")
        con.commit()
        code = atlas_run(["replay", "check", str(trace)])
        out = capsys.readouterr().out
        assert code == 1, out
        assert (f"TRUNCATED: the run-end marker counts {total} events, {total - lost} are on disk (the last {lost} "
                "lost after the run ended)") in out
        assert atlas_run(["trace", "show", str(trace)]) == 0
        assert "TRUNCATED: the run-end marker counts" in capsys.readouterr().out
    assert atlas_run(["replay", "verify", str(trace)]) == 1
    assert "TRUNCATED: the run-end marker counts" in capsys.readouterr().out
    # an event past the count is as wrong: more on disk than the marker says
    con.execute("UPDATE run_status SET events = 3")
    con.commit()
    con.close()
    assert atlas_run(["replay", "check", str(trace)]) == 1
    assert "CORRUPT:" in capsys.readouterr().out
