"""The `atlas trace export/import/minimize` and `atlas replay against` commands (registered by atlas.cli)."""

from __future__ import annotations

import typer


def register(trace_app: typer.Typer, replay_app: typer.Typer) -> None:
    @replay_app.command("against")
    def replay_against(file: str, run_id: int = typer.Option(None, help="default: the last run in the store")
                       ) -> None:
        """Re-drive a trace's inputs through the current code: the first divergent event as a field diff, and
        the outcome (failure gone, still there, new failure, passes). Exit 1 when today's run fails."""
        from atlas.replay.against import NEW_FAILURE, STILL_THERE, against

        report = against(file, run_id)
        typer.echo(report.describe())
        if report.outcome in (STILL_THERE, NEW_FAILURE):
            raise typer.Exit(1)

    @trace_app.command("export")
    def trace_export(file: str, out: str = typer.Option(..., "-o", "--out", help="the JSON lines file to write"),
                     run_id: int = typer.Option(None, help="default: the last run in the store")) -> None:
        """Write one run as JSON lines: a header line with the run, then one line per event (as recorded)."""
        from atlas.replay.jsonl import export_jsonl

        n = export_jsonl(file, out, run_id)
        typer.echo(f"exported {n} events to {out}")

    @trace_app.command("import")
    def trace_import(file: str, out: str = typer.Option(..., "-o", "--out", help="the trace store to append to")
                     ) -> None:
        """Append the run in a JSON lines file to a trace store (a SQLite path or a SQLAlchemy URL)."""
        from atlas.replay.jsonl import import_jsonl

        run_id = import_jsonl(file, out)
        typer.echo(f"imported as run {run_id} of {out}")

    @trace_app.command("minimize")
    def trace_minimize(file: str, out: str = typer.Option(..., "-o", "--out", help="the trace to write"),
                       run_id: int = typer.Option(None, help="default: the last run in the store"),
                       max_runs: int = typer.Option(2000, help="candidate replays to try, at most")) -> None:
        """Shrink a failing trace (drop requests, shorten prompts and budgets, drop cancellations and faults,
        fewer steps) while replaying it under today's code still fails the same way."""
        from atlas.replay.minimize import minimize

        try:
            m = minimize(file, out, run_id, max_runs=max_runs)
        except ValueError as exc:
            typer.echo(f"cannot minimise: {exc}")
            raise typer.Exit(1) from exc
        typer.echo(f"minimised after {m.runs} replays: {m.events_before} -> {len(m.rows)} events, "
                   f"{m.requests_before} -> {m.requests} requests; still fails: {m.failure.describe()}")
        typer.echo(f"written to {out}")
