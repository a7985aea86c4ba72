"""A full disk and an unreachable URL are one line naming the path or URL, exit 2, never a traceback.

The full disk is a file-size limit (RLIMIT_FSIZE) in a fresh interpreter: every write past it fails (EFBIG; Python
ignores SIGXFSZ), as every write does on a full device. With a limit of 0 even Python's temporary directory is
refused (torch's import asks for one); with 1 KiB a trace's first page is.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from atlas.cli import run as atlas_run


def _limited(limit: int, *argv: str) -> subprocess.CompletedProcess[str]:
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", "from atlas.cli import main; main()", *argv], capture_output=True,
                          text=True, timeout=120, env=env, preexec_fn=cap)


def _one_line(done: subprocess.CompletedProcess[str], *named: str) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "internal error" not in lines[0] and "Traceback" not in done.stderr, done.stderr
    for name in named:
        assert name in lines[0], lines[0]
    return lines[0]


def test_no_room_for_a_temporary_file_at_start_up(tmp_path: Path) -> None:
    line = _one_line(_limited(0, "generate", "--prompt", "hi", "--backend", "null"), "temporary directory")
    assert "ulimit -f" in line and "TMPDIR" in line


def test_no_room_for_the_trace_at_start_up(tmp_path: Path) -> None:
    trace = tmp_path / "run.db"
    for argv in (("generate", "--prompt", "hi", "--backend", "null", "--trace", str(trace)),
                 ("serve", "--backend", "null", "--port", "0", "--trace", str(trace))):
        line = _one_line(_limited(1024, *argv), str(trace))
        assert "cannot be written" in line and "1024 bytes" in line, line
        assert not trace.exists()  # nothing left behind to read as an empty trace later


def test_no_room_for_an_export_or_an_import(tmp_path: Path) -> None:
    trace, lines = tmp_path / "run.db", tmp_path / "run.jsonl"
    assert atlas_run(["generate", "--prompt", "hi", "--backend", "null", "--max-tokens", "3", "--trace",
                      str(trace)]) == 0
    assert atlas_run(["trace", "export", str(trace), "-o", str(lines)]) == 0
    out = tmp_path / "out.jsonl"
    _one_line(_limited(100, "trace", "export", str(trace), "-o", str(out)), str(out), "cannot be written")
    assert not out.exists()
    store = tmp_path / "store.db"
    _one_line(_limited(1024, "trace", "import", str(lines), "-o", str(store)), str(store), "cannot be written")


@pytest.mark.parametrize("url", ["http://127.0.0.1:9", "http://[::1]:9/"])
def test_bench_serve_to_a_dead_url_is_one_line(capsys, url: str) -> None:
    code = atlas_run(["bench", "serve", "--base-url", url, "--num-prompts", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "internal error" not in err, err
    assert [line for line in err.splitlines() if line.strip()] == [err.strip()] and url in err and "no server" in err


def test_bench_serve_refuses_a_url_that_is_not_one(capsys) -> None:
    for url in ("localhost:8000", "ftp://host/", "http://", "http://host:port/"):
        code = atlas_run(["bench", "serve", "--base-url", url])
        err = capsys.readouterr().err
        assert code == 2 and url in err and len(err.strip().splitlines()) == 1, err
