"""Every corrupt, truncated or foreign input is one line on stderr naming the file and what is wrong, exit 2.

A real trace is recorded once (atlas-tiny on the CPU, two prompts, a few tokens), then damaged in every way a user's
file can be: cut at several byte offsets, pages zeroed, random bytes, a foreign SQLite database, the right tables
with a wrong schema or trace schema, rows whose payloads are not their events, an empty file, a directory, a missing
path; and JSON lines that are not JSON, have the wrong fields, or end in a cut line. Each command that reads such a
file runs on each of them in-process (atlas.cli.run: fast) and once per command in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from atlas.cli import run as atlas_run

PAGE = 4096


def _atlas(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = atlas_run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _fresh(*argv: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", "from atlas.cli import main; main()", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)


def _one_line_naming(code: int, err: str, target: Path | str, argv: tuple[str, ...]) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "internal error" not in err, (argv, err)
    assert code == 2, (argv, code, err)
    assert len(lines) == 1, (argv, err)
    assert str(target) in lines[0], (argv, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real trace, recorded once and closed (its run-end marker written)."""
    trace = tmp_path_factory.mktemp("corpus") / "good.db"
    code = atlas_run(["generate", "--prompt", "hello there", "--prompt", "abc", "--max-tokens", "3",
                      "--max-seq-len", "64", "--max-batch-size", "2", "--trace", str(trace)])
    assert code == 0 and trace.is_file() and not Path(f"{trace}-wal").exists()
    return trace


# -- the damaged traces --------------------------------------------------------------------------------------

def _edit(sql: str, *params: object) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        con = sqlite3.connect(path)
        con.execute("PRAGMA journal_mode=DELETE")  # the variant is one file, no -wal beside it
        con.execute(sql, params)
        con.commit()
        con.close()
    return apply


def _bytes(change: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(change(path.read_bytes()))


def _zero_page(n: int) -> Callable[[Path], None]:
    return _bytes(lambda b: b[:(n - 1) * PAGE] + bytes(PAGE) + b[n * PAGE:])


def _foreign(path: Path) -> None:
    path.unlink()
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO users (name) VALUES ('ada')")
    con.commit()
    con.close()


def _no_tables(path: Path) -> None:
    path.unlink()
    con = sqlite3.connect(path)
    con.execute("PRAGMA user_version = 7")  # a valid SQLite file with no table at all
    con.commit()
    con.close()


def _first_row(kind: str) -> str:
    return f"(SELECT min(idx) FROM events WHERE kind = '{kind}')"


def _cut_blob(path: Path) -> None:
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=DELETE")
    idx, blob = con.execute("SELECT idx, payload FROM events WHERE typeof(payload) = 'blob' LIMIT 1").fetchone()
    con.execute("UPDATE events SET payload = ? WHERE idx = ?", (blob[:-3], idx))
    con.commit()
    con.close()


RANDOM = random.Random(40)
DAMAGE: dict[str, Callable[[Path], None]] = {
    "cut at 50 bytes": _bytes(lambda b: b[:50]),
    "cut at 100 bytes": _bytes(lambda b: b[:100]),
    "cut inside page 2": _bytes(lambda b: b[:PAGE + 1234]),
    "cut at a page boundary": _bytes(lambda b: b[:2 * PAGE]),
    "cut one byte short": _bytes(lambda b: b[:-1]),
    "page 1 zeroed": _zero_page(1),
    "page 2 zeroed": _zero_page(2),
    "page 3 zeroed": _zero_page(3),
    "page 4 zeroed": _zero_page(4),
    "page 5 zeroed": _zero_page(5),
    "random bytes": _bytes(lambda b: RANDOM.randbytes(len(b))),
    "random bytes after a SQLite header": _bytes(lambda b: b[:100] + RANDOM.randbytes(len(b) - 100)),
    "JSON lines where a database was due": _bytes(lambda b: b'{"format": "atlas-trace"}\n'),
    "a foreign SQLite database": _foreign,
    "a SQLite database with no tables": _no_tables,
    "events without a digest column": _edit("ALTER TABLE events DROP COLUMN digest"),
    "a trace schema from the future": _edit("UPDATE runs SET config = json_set(config, '$.trace_schema', 99)"),
    "a run config that is not JSON": _edit("UPDATE runs SET config = '{not json'"),
    "a payload that is not JSON": _edit(f"UPDATE events SET payload = '{{\"seq_id\": ' WHERE idx = "
                                        f"{_first_row('request_finished')}"),
    "a payload lacking a field": _edit(f"UPDATE events SET payload = json_remove(payload, '$.reason') WHERE idx = "
                                       f"{_first_row('request_finished')}"),
    "a payload field of the wrong type": _edit(f"UPDATE events SET payload = json_set(payload, '$.seq_id', 'x') "
                                               f"WHERE idx = {_first_row('request_finished')}"),
    "a payload that is a list": _edit(f"UPDATE events SET payload = '[1, 2]' WHERE idx = "
                                      f"{_first_row('request_finished')}"),
    "an unknown event kind": _edit(f"UPDATE events SET kind = 'teleported' WHERE idx = "
                                   f"{_first_row('request_finished')}"),
    "an event version from the future": _edit(f"UPDATE events SET version = 99 WHERE idx = "
                                              f"{_first_row('request_finished')}"),
    "a codec-1 payload cut short": _cut_blob,
    "a gap in the event indices": _edit("UPDATE events SET idx = idx + 1000 WHERE idx = 3"),
    "an empty file": _bytes(lambda b: b""),
}
# what a writer may still append to (a store without tables is one it initialises; a row it never reads is another
# run's): serve --trace is refused on every other damage
WRITABLE = {"a SQLite database with no tables", "an empty file", "a payload that is not JSON", "a payload lacking a field",
            "a payload field of the wrong type", "a payload that is a list", "an unknown event kind",
            "an event version from the future", "a codec-1 payload cut short", "a gap in the event indices"}


@pytest.fixture(scope="module")
def corpus(good: Path) -> dict[str, Path]:
    out = {}
    for i, (name, damage) in enumerate(DAMAGE.items()):
        path = good.with_name(f"bad{i}.db")
        shutil.copyfile(good, path)
        damage(path)
        out[name] = path
    directory = good.with_name("a-directory.db")
    directory.mkdir()
    out["a directory"] = directory
    out["a missing file"] = good.with_name("missing.db")
    return out


def _readers(trace: Path) -> list[tuple[str, ...]]:
    return [("trace", "show", str(trace)), ("trace", "export", str(trace), "-o", str(trace.with_suffix(".jsonl"))),
            ("replay", "check", str(trace)), ("replay", "verify", str(trace)), ("replay", "against", str(trace)),
            ("trace", "minimize", str(trace), "-o", str(trace.with_name("small.db")))]


def test_every_reader_names_every_damaged_trace_in_one_line(capsys, corpus: dict[str, Path]) -> None:
    for name, trace in corpus.items():
        for argv in _readers(trace):
            code, out, err = _atlas(capsys, *argv)
            line = _one_line_naming(code, err, trace, (name, *argv))
            assert line.startswith("atlas: ") and (name, line)
        assert not trace.with_suffix(".jsonl").exists(), name  # export leaves nothing behind


def test_a_damaged_trace_is_refused_as_a_store_to_append_to(capsys, corpus: dict[str, Path]) -> None:
    with socket.socket() as busy:  # were the trace accepted, the port would be refused: never a server
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for name, trace in corpus.items():
            if name in WRITABLE or name == "a missing file":
                continue
            before = trace.read_bytes() if trace.is_file() else None
            argv = ("serve", "--backend", "null", "--port", port, "--trace", str(trace))
            code, _, err = _atlas(capsys, *argv)
            _one_line_naming(code, err, trace, (name, *argv))
            assert (trace.read_bytes() if trace.is_file() else None) == before, name


def test_each_command_says_so_in_a_fresh_process(corpus: dict[str, Path], good: Path, tmp_path: Path) -> None:
    zeroed, cut, bad_row = corpus["page 4 zeroed"], corpus["cut inside page 2"], corpus["a payload lacking a field"]
    runs = [(argv, cut) for argv in _readers(cut)] + [(argv, bad_row) for argv in _readers(bad_row)[:3]]
    runs.append((("serve", "--backend", "null", "--port", "0", "--trace", str(zeroed)), zeroed))
    lines = tmp_path / "bad.jsonl"
    lines.write_text('{"format": "atlas-trace", "format_version": 1, "run": {}}\n')
    runs.append((("trace", "import", str(lines), "-o", str(tmp_path / "out.db")), lines))
    for argv, target in runs:
        done = _fresh(*argv, timeout=60)
        _one_line_naming(done.returncode, done.stderr, target, argv)
    assert not (tmp_path / "out.db").exists()


# -- JSON lines ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(good: Path) -> list[str]:
    out = good.with_name("good.jsonl")
    assert atlas_run(["trace", "export", str(good), "-o", str(out)]) == 0
    return out.read_text().splitlines(keepends=True)


def _jsonl_variants(lines: list[str]) -> dict[str, str]:
    header, first, *rest = lines
    row = json.loads(first)
    return {
        "invalid JSON": header + "{not json\n" + "".join(rest),
        "a truncated last line": "".join(lines)[:-25],
        "an event line with wrong fields": header + json.dumps({"index": 0, "kind": "x"}) + "\n" + "".join(rest),
        "a payload lacking its fields": header + json.dumps({**row, "payload": {}}) + "\n" + "".join(rest),
        "an unknown kind": header + json.dumps({**row, "kind": "teleported"}) + "\n" + "".join(rest),
        "a gap in the indices": header + "".join(rest),
        "a line that is a list": header + "[1, 2, 3]\n",
        "a header of another format": json.dumps({"format": "csv"}) + "\n" + "".join(rest),
        "a header from a newer Atlas": json.dumps({**json.loads(header), "format_version": 9}) + "\n",
        "a header without its run": json.dumps({"format": "atlas-trace", "format_version": 1}) + "\n",
        "an empty file": "",
    }


def test_trace_import_names_every_bad_json_lines_file(capsys, exported: list[str], good: Path,
                                                      tmp_path: Path) -> None:
    target = tmp_path / "store.db"
    for name, text in _jsonl_variants(exported).items():
        src = tmp_path / "in.jsonl"
        src.write_text(text)
        line = _one_line_naming(*_atlas(capsys, "trace", "import", str(src), "-o", str(target))[::2], src, (name,))
        assert "line " in line or name == "an empty file", line
        assert not target.exists(), name  # checked whole before anything is written
    src = tmp_path / "binary.jsonl"
    src.write_bytes(b"\xff\xfe\x00garbage")
    _one_line_naming(*_atlas(capsys, "trace", "import", str(src), "-o", str(target))[::2], src, ("binary",))
    # a good file into a store that is not a trace: the store is named, and left as it was
    src.write_text("".join(exported))
    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE users (id INTEGER)")
    con.commit()
    con.close()
    before = foreign.read_bytes()
    _one_line_naming(*_atlas(capsys, "trace", "import", str(src), "-o", str(foreign))[::2], foreign, ("foreign",))
    assert foreign.read_bytes() == before
