"""The `atlas trace ...` and `atlas replay ...` commands (registered by atlas.cli).

Results go to stdout; progress and logs to stderr. Every command that reads a trace checks first that it
exists (a missing SQLite path would otherwise be created empty), and those that re-drive a model take
`--threads` (the policy of atlas/threads.py: 1 by default, measured).
"""

from __future__ import annotations

import sys

import typer

from atlas.cli_checks import check_trace_in, check_trace_out
from atlas.errors import TraceFileError

RUN_ID_HELP = "default: the last run in the store"
THREADS_HELP = "torch CPU threads (default: OMP_NUM_THREADS, else 1)"


def register(trace_app: typer.Typer, replay_app: typer.Typer) -> None:
    @trace_app.command("show")
    def trace_show(file: str, run_id: int = typer.Option(None, help=RUN_ID_HELP)) -> None:
        """Run summary, per-request outcome and event counts of a trace."""
        from rich.console import Console

        from atlas.replay.show import render
        from atlas.replay.summary import summarize

        check_trace_in(file)
        # a pipe gets room for the tables (rich assumes 80 columns off a terminal and truncates cells)
        render(summarize(file, run_id), Console(width=None if sys.stdout.isatty() else 160))

    @replay_app.command("verify")
    def replay_verify(
        file: str,
        run_id: int = typer.Option(None, help=RUN_ID_HELP),
        audit: bool = typer.Option(False, help="also audit every state machine in full after every event"),
        threads: int = typer.Option(None, help=THREADS_HELP),
    ) -> None:
        """Re-drive a trace's inputs through a fresh engine; exit 1 at the first divergent event."""
        from atlas.cli_support import progress_bar
        from atlas.replay.summary import run_end
        from atlas.replay.verify import verify
        from atlas.threads import apply_threads

        check_trace_in(file)
        apply_threads(threads)
        end = run_end(file, run_id)  # first: a trace whose marker cannot be read fails before a model loads
        with progress_bar("replaying events", None) as update:
            report = verify(file, run_id, progress=update, engine_kwargs={"full_audit": audit})
        if not report.fingerprint_matches:
            typer.echo(f"warning: model fingerprint {report.fingerprint[:16]} differs from the trace's "
                       f"{report.run.model_fingerprint[:16]}", err=True)
        if report.identical and end.truncated:
            typer.echo(f"{end.describe()}; the {report.events_replayed} events on disk replay identically")
            raise typer.Exit(1)
        if report.identical:
            typer.echo(f"identical: {report.events_replayed} events replayed, every payload and digest matches")
            return
        typer.echo(report.divergence.describe())
        if end.truncated:
            typer.echo(end.describe())
        raise typer.Exit(1)

    @replay_app.command("check")
    def replay_check(file: str, run_id: int = typer.Option(None, help=RUN_ID_HELP)) -> None:
        """State-only replay: apply the trace's events to the state machines (no model), checking every invariant
        and digest; exit 1 at the first problem."""
        from atlas.replay.summary import run_end
        from atlas.replay.verify import check_state_only

        check_trace_in(file)
        end = run_end(file, run_id)
        report = check_state_only(file, run_id)
        if end.truncated:  # the events on disk may be consistent, but the run did not end there
            typer.echo(f"{end.describe()}; the events on disk are "
                       f"{'consistent' if report.problem is None else 'inconsistent: ' + str(report.problem)}")
            raise typer.Exit(1)
        if report.problem is None:
            typer.echo(f"consistent: {report.events} events applied, every invariant and digest holds")
            return
        typer.echo(f"event {report.index}: {report.problem}")
        raise typer.Exit(1)

    @replay_app.command("against")
    def replay_against(file: str, run_id: int = typer.Option(None, help=RUN_ID_HELP),
                       threads: int = typer.Option(None, help=THREADS_HELP)) -> None:
        """Re-drive a trace's inputs through the current code: `identical`, or the first divergent event as a
        field diff; then the outcome (failure gone, still there, new failure, passes). Exit 1 when today's run
        fails."""
        from atlas.cli_support import progress_bar
        from atlas.replay.against import NEW_FAILURE, STILL_THERE, against
        from atlas.replay.summary import run_end
        from atlas.threads import apply_threads

        check_trace_in(file)
        apply_threads(threads)
        run_end(file, run_id)  # the run-end marker read (a damaged one is named) before a model loads
        with progress_bar("replaying events", None) as update:
            report = against(file, run_id, progress=update)
        typer.echo(report.describe())
        if report.outcome in (STILL_THERE, NEW_FAILURE):
            raise typer.Exit(1)

    @trace_app.command("export")
    def trace_export(file: str, out: str = typer.Option(..., "-o", "--out", help="the JSON lines file to write"),
                     run_id: int = typer.Option(None, help=RUN_ID_HELP)) -> None:
        """Write one run as JSON lines: a header line with the run, then one line per event (as recorded)."""
        from atlas.replay.jsonl import export_jsonl

        check_trace_in(file)
        check_trace_out(out, knob="--out", store=False)
        n = export_jsonl(file, out, run_id)
        typer.echo(f"exported {n} events to {out}")

    @trace_app.command("import")
    def trace_import(file: str, out: str = typer.Option(..., "-o", "--out", help="the trace store to append to")
                     ) -> None:
        """Append the run in a JSON lines file to a trace store (a SQLite path or a SQLAlchemy URL)."""
        from atlas.replay.jsonl import import_jsonl

        check_trace_in(file)
        check_trace_out(out, knob="--out")
        run_id = import_jsonl(file, out)
        typer.echo(f"imported as run {run_id} of {out}")

    @trace_app.command("minimize")
    def trace_minimize(file: str, out: str = typer.Option(..., "-o", "--out", help="the trace to write"),
                       run_id: int = typer.Option(None, help=RUN_ID_HELP),
                       max_runs: int = typer.Option(2000, help="candidate replays to try, at most"),
                       threads: int = typer.Option(None, help=THREADS_HELP)) -> None:
        """Shrink a failing trace (drop requests, shorten prompts and budgets, drop cancellations and faults,
        fewer steps) while replaying it under today's code still fails the same way."""
        from atlas.replay.minimize import minimize
        from atlas.replay.summary import run_end
        from atlas.threads import apply_threads

        check_trace_in(file)
        check_trace_out(out, knob="--out")
        apply_threads(threads)
        run_end(file, run_id)  # the run-end marker read (a damaged one is named) before the replays
        try:
            m = minimize(file, out, run_id, max_runs=max_runs)
        except TraceFileError:
            raise  # a trace it cannot read: one line, exit 2 (atlas.cli)
        except ValueError as exc:
            typer.echo(f"cannot minimise: {exc}")
            raise typer.Exit(1) from exc
        typer.echo(f"minimised after {m.runs} replays: {m.events_before} -> {len(m.rows)} events, "
                   f"{m.requests_before} -> {m.requests} requests; still fails: {m.failure.describe()}")
        typer.echo(f"written to {out}")
