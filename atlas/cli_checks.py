"""What the `atlas` commands check before they build anything: each user mistake becomes one `UsageError` line
that names the knob, the value and what to do (exit status 2), instead of a traceback from deep inside.

The checks are cheap (no model is loaded, no GPU touched beyond `torch.cuda.is_available()`), so a command
fails in well under a second on a bad flag rather than after loading a checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

from atlas.model.names import MINI_MODEL_DIR, MINI_MODEL_NAME
from atlas.model.names import TINY_MODEL_NAME as TINY_MODEL

DEFAULT_MAX_SEQ_LEN = 4096  # EngineConfig's default
TOKENIZERS = ("auto", "byte")
SERVE_BACKENDS = ("cpu", "cuda", "cuda-fp32", "cuda-invariant", "cuda-fp32-invariant", "null")


class UsageError(Exception):
    """A user's mistake, said in one line; the CLI prints it and exits with status 2."""


def is_url(target: str) -> bool:
    return "://" in target


def check_temp_dir() -> None:
    """Python's temporary directory: importing torch asks for one (tempfile.gettempdir, through dill), and on a full
    disk none is usable (each candidate refuses a 4-byte probe file): one line naming the directory, not a
    traceback from an import."""
    import tempfile

    try:
        tempfile.gettempdir()
    except OSError as exc:
        from atlas.replay.sqlite_file import space_note

        target = os.environ.get("TMPDIR") or "/tmp"
        raise UsageError(f"{exc.strerror or exc}: each refused a 4-byte probe file (is the disk full? "
                         f"{target!r}{space_note(Path(target) / 'probe')}); free space or set TMPDIR to a writable "
                         "directory") from None


def check_trace_in(file: str) -> None:
    """A trace to read must exist (a missing SQLite path would otherwise be created empty)."""
    if is_url(file):
        return
    path = Path(file).expanduser()
    if not path.exists():
        raise UsageError(f"trace {file!r} does not exist; pass the path a run was recorded to (--trace PATH)")
    if path.is_dir():
        raise UsageError(f"trace {file!r} is a directory; pass the trace file (a SQLite path)")


def check_trace_out(trace: str | None, *, knob: str = "--trace", store: bool = True) -> None:
    """A trace to write: its directory must exist and be writable, and the path must not be a directory; `store`
    (a trace store, appended to): an existing file must be a whole Atlas trace (header, tables, read without
    writing, PRAGMA quick_check included). `store` False: a plain output file."""
    if trace is None or is_url(trace):
        return
    path = Path(trace).expanduser()
    if path.is_dir():
        raise UsageError(f"{knob} {trace!r} is a directory; pass a file path such as {str(path / 'run.db')!r}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{knob} {trace!r}: directory {str(parent)!r} does not exist; create it or pick another path")
    if path.exists() and not os.access(path, os.W_OK) or not os.access(parent, os.W_OK):
        raise UsageError(f"{knob} {trace!r} is not writable; pick a path in a directory you can write to")
    if store:
        from atlas.replay.run_rows import check_for_append

        check_for_append(path)  # a TraceFileError names the file (exit 2) before any model is loaded


def check_base_url(url: str) -> None:
    """`--base-url`: an http(s) URL with a host (the server is asked only when the command runs)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError as exc:
        raise UsageError(f"--base-url {url!r} is not a URL ({exc}); pass one such as http://127.0.0.1:8000") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--base-url {url!r} is not an http(s) URL with a host; pass one such as "
                         "http://127.0.0.1:8000")


def check_out_file(out: str, *, knob: str = "--out") -> None:
    check_trace_out(out, knob=knob, store=False)


def check_backend(backend: str, choices: tuple[str, ...]) -> None:
    if backend not in choices:
        raise UsageError(f"--backend {backend!r} is not a backend; use one of {', '.join(choices)}")
    if backend.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--backend {backend}: no CUDA GPU is visible to torch {torch.__version__} on this "
                             "machine; use --backend cpu")


def check_tuning(tuning: str | None, backend: str) -> None:
    """`--tuning NAME`: one of the CUDA backend's arrangements (atlas.backends.cuda.tuning.TUNINGS), on a CUDA
    backend only (the CPU reference has one arithmetic)."""
    if tuning is None:
        return
    from atlas.registry import TUNINGS

    if tuning not in TUNINGS:
        raise UsageError(f"--tuning {tuning!r} is not a CUDA tuning; use one of {', '.join(TUNINGS)}")
    if not backend.startswith("cuda"):
        raise UsageError(f"--tuning {tuning} picks the CUDA backend's kernels; --backend {backend} has none "
                         "(use --backend cuda, or drop --tuning)")


def check_model(model: str, tokenizer: str = "auto") -> None:
    """`model` is atlas-tiny or a checkpoint directory with config.json (and tokenizer.json unless
    `--tokenizer byte`). A hub id is refused with what to do: Atlas never downloads (offline by design)."""
    if tokenizer not in TOKENIZERS:
        raise UsageError(f"--tokenizer {tokenizer!r} is not a tokenizer mode; use auto (the checkpoint's "
                         "tokenizer.json) or byte")
    if model == TINY_MODEL:
        return
    path = _model_path(model)
    if model == MINI_MODEL_NAME and not (path / "config.json").is_file():
        raise UsageError(f"--model atlas-mini: no checkpoint in {path} (tools/train_mini.py trains it; see "
                         "tools/README.md)")
    if not path.exists():
        looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
        if looks_like_hub_id:
            raise UsageError(f"--model {model!r} is not a directory here; Atlas loads checkpoints from disk and never "
                             f"downloads: fetch it first (huggingface-cli download {model} --local-dir DIR) and "
                             "pass --model DIR")
        raise UsageError(f"--model {model!r} does not exist; pass a checkpoint directory, {MINI_MODEL_NAME} or "
                         f"{TINY_MODEL}")
    if not path.is_dir():
        raise UsageError(f"--model {model!r} is a file; pass the checkpoint directory that holds config.json")
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {model!r} has no config.json; pass a checkpoint directory (config.json, "
                         "*.safetensors, tokenizer.json)")
    has_tokenizer = (path / "tokenizer.json").is_file()
    if tokenizer == "auto" and not has_tokenizer:
        raise UsageError(f"--model {model!r} has no tokenizer.json; add the checkpoint's tokenizer.json, or pass "
                         "--tokenizer byte to use the byte tokenizer (ids 0-255 are bytes)")
    if tokenizer == "byte" and has_tokenizer:
        raise UsageError(f"--tokenizer byte: {model!r} has a tokenizer.json, which Atlas uses (a replay loads it "
                         "too); leave --tokenizer at auto")


def _model_path(model: str) -> Path:
    """The directory `--model` names: atlas-mini is the repo's models/atlas-mini, anything else a path."""
    return MINI_MODEL_DIR if model == MINI_MODEL_NAME else Path(model).expanduser()


def model_max_positions(model: str) -> int | None:
    """The checkpoint's max_position_embeddings, read from config.json alone (None: unknown or atlas-tiny)."""
    if model == TINY_MODEL:
        return None
    try:
        config = json.loads((_model_path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    value = config.get("max_position_embeddings", text_config.get("max_position_embeddings"))
    return int(value) if isinstance(value, int) and value > 0 else None


def default_max_seq_len(model: str, requested: int | None, fallback: int = DEFAULT_MAX_SEQ_LEN) -> int:
    """`requested` when given (refused past the model's max_position_embeddings, naming both numbers); else the
    fallback, lowered to the model's max_position_embeddings when that is smaller."""
    if requested is not None:
        limit = model_max_positions(model)
        if limit is not None and requested > limit:
            raise UsageError(f"--max-seq-len {requested} exceeds the model's max_position_embeddings {limit}; "
                             f"pass --max-seq-len {limit} or less (or leave it out)")
        return requested
    limit = model_max_positions(model)
    if limit is not None and limit < fallback:
        return limit
    return fallback


def check_port(host: str, port: int) -> None:
    """The address must be free now: a port in use is a usage error (exit 2), not an engine fault."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is not a TCP port; use 1-65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is not "in use"
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"--port {port}: {host}:{port} is already in use; stop the other server or pass "
                             "--port N") from None
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(exc, socket.gaierror):
            raise UsageError(f"--host {host!r} is not an address of this machine ({exc.strerror}); use 127.0.0.1 "
                             "or 0.0.0.0") from None
        if exc.errno == errno.EACCES:
            raise UsageError(f"--port {port} needs privileges on {host}; use a port above 1023") from None
        raise UsageError(f"--host {host} --port {port}: cannot bind ({exc.strerror})") from None
    finally:
        sock.close()
