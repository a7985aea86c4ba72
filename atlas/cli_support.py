"""How the `atlas` commands present themselves: logs on stderr, progress bars on stderr, plain help.

stdout carries only a command's results (completions, reports, tables), so that `atlas ... > out.txt` or a pipe
gets the results alone; everything else (structlog lines, progress) goes to stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class _Stderr:
    """Resolved at each write, so a replaced sys.stderr (tests, redirection) is followed."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def logs_to_stderr(*, force: bool = True) -> None:
    """Send structlog's output to stderr (its default is stdout). `force=False` leaves a configuration the
    application already made alone (atlas.LLM is a library: the caller's logging wins)."""
    import structlog

    if not force and structlog.is_configured():
        return
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(_Stderr()))


@contextmanager
def progress_bar(label: str, total: int | None, *, enabled: bool = True) -> Iterator[Callable[[int, int | None], Any]]:
    """A transient rich progress bar on stderr; yields `update(done, total)`. On a non-terminal stderr (a pipe,
    CI, tests) rich draws nothing, so the command's stderr stays free of bar frames."""
    if not enabled:
        yield lambda done, total=None: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(label, total=total)

        def update(done: int, new_total: int | None = None) -> None:
            bar.update(task, completed=done, **({"total": new_total} if new_total is not None else {}))

        yield update


# value names shown in --help instead of typer's type labels (<int>, <str>, <list[str]>)
_METAVARS = {
    "model": "DIR", "trace": "PATH", "file": "TRACE", "out": "PATH", "config": "FILE", "result_json": "FILE",
    "base_url": "URL", "host": "ADDR", "api_key": "KEY", "backend": "NAME", "drafter": "NAME", "tokenizer": "MODE",
    "served_model_name": "NAME", "prompt": "TEXT", "stop": "TEXT",
}


def plain_metavars(command: Any) -> None:
    """Replace type labels with value names in every option and argument of a (typer) click command tree."""
    for param in getattr(command, "params", ()):
        if getattr(param, "is_flag", False) or getattr(param, "count", False):
            continue
        if getattr(param, "metavar", None) is None:
            annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
            by_type = {int: "N", float: "X"}.get(annotation, "VALUE")  # type: ignore[call-overload]
            param.metavar = _METAVARS.get(param.name or "") or by_type
    for sub in getattr(command, "commands", {}).values():
        plain_metavars(sub)
