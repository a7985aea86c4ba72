"""The `atlas` command."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Atlas: serve and replay hybrid LMs.")


@app.command()
def version() -> None:
    """Print the Atlas version."""
    from atlas import __version__

    typer.echo(__version__)


@app.command()
def serve(
    model: str = typer.Option(None, help="checkpoint directory; the built-in atlas-tiny when omitted"),
    host: str = typer.Option("127.0.0.1", help="bind address (loopback unless told otherwise)"),
    port: int = typer.Option(8000),
    trace: str = typer.Option(None, help="trace store: a SQLite path or a SQLAlchemy URL"),
    api_key: str = typer.Option(None, envvar="ATLAS_API_KEY", help="require 'Authorization: Bearer KEY'"),
    backend: str = typer.Option("cpu", help="cpu | cuda | null"),
    max_seq_len: int = typer.Option(None),
    max_batch_size: int = typer.Option(None),
    enable_fault_injection: bool = typer.Option(False, hidden=True, help="tests only: fault-injection hooks"),
) -> None:
    """Serve the OpenAI-compatible API. Exits non-zero if the engine dies of a fatal fault."""
    from atlas.server.serve import serve as run_server

    code = run_server(model, host=host, port=port, trace=trace, api_key=api_key, backend=backend,
                      max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                      enable_fault_injection=enable_fault_injection)
    raise typer.Exit(code)


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks.")
app.add_typer(bench_app, name="bench")


@bench_app.command("serve")
def bench_serve(
    base_url: str = typer.Option(None, help="a running server; omitted: start one in-process"),
    model: str = typer.Option(None, help="in-process server: checkpoint dir (atlas-tiny when omitted)"),
    backend: str = typer.Option("cpu", help="in-process server: backend"),
    max_seq_len: int = typer.Option(None),
    max_batch_size: int = typer.Option(None),
    num_prompts: int = typer.Option(100),
    random_input_len: int = typer.Option(64),
    random_output_len: int = typer.Option(32),
    request_rate: float = typer.Option(float("inf"), help="requests/s (Poisson); inf sends all at once"),
    max_concurrency: int = typer.Option(None),
    seed: int = typer.Option(0),
    api_key: str = typer.Option(None, envvar="ATLAS_API_KEY"),
    result_json: str = typer.Option(None, help="also write the figures to this JSON file"),
) -> None:
    """Load-test a server like vLLM's bench serve: TTFT, TPOT, ITL (p50/p99) and throughput."""
    import json

    from atlas.server.bench import BenchConfig, format_report
    from atlas.server.bench import bench_serve as run_bench

    cfg = BenchConfig(base_url=base_url or "", num_prompts=num_prompts, input_len=random_input_len,
                      output_len=random_output_len, request_rate=request_rate, max_concurrency=max_concurrency,
                      seed=seed, api_key=api_key)
    launch = None
    if base_url is None:
        launch = {"model": model, "backend": backend, "max_seq_len": max_seq_len, "max_batch_size": max_batch_size}
    result = run_bench(cfg, launch=launch)
    typer.echo(format_report(result, cfg))
    if result_json:
        with open(result_json, "w") as f:
            json.dump(result, f, indent=2)
    if result["failed"]:
        raise typer.Exit(1)


def main() -> None:
    app()
