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
    api_key: str = typer.Option(None, help="require 'Authorization: Bearer KEY' (visible in ps: prefer "
                                "--api-key-file or the ATLAS_API_KEY variable; an empty key is an error)"),
    backend: str = typer.Option("cpu", help="cpu | cuda | null"),
    max_seq_len: int = typer.Option(None),
    max_batch_size: int = typer.Option(None),
    loop_watchdog: bool = typer.Option(False, help="roll content loops back (non-streaming requests)"),
    ring_slots: int = typer.Option(None, help="boundary snapshots per sequence for rollback (0: declines)"),
    num_drafts: int = typer.Option(None, help="speculative decoding: drafts per verify (0: off)"),
    drafter: str = typer.Option(None, help="speculative drafter: mtp | ngram"),
    prefix_caching: bool = typer.Option(None, "--prefix-caching/--no-prefix-caching",
                                        help="reuse KV + recurrent state of shared prefixes (default: on for cpu)"),
    threads: int = typer.Option(None, help="torch CPU threads for the engine (default: cores - 1)"),
    enable_fault_injection: bool = typer.Option(False, hidden=True, help="tests only: fault-injection hooks"),
    # -- auth, shutdown and connection bounds (atlas/server/auth.py, lifecycle.py, connections.py) --
    api_key_file: str = typer.Option(None, help="read the API key from this file's first line"),
    allow_unauthenticated: bool = typer.Option(False, help="serve a non-loopback --host without an API key"),
    shutdown_grace: float = typer.Option(30.0, help="seconds in-flight requests get to finish on SIGTERM/SIGINT"),
    max_connections: int = typer.Option(None, help="open connections at most (default: the fd limit - 256)"),
    max_concurrency: int = typer.Option(4096, help="requests in flight at most (probes excepted), then 503"),
    header_timeout: float = typer.Option(10.0, help="seconds for a request's headers to arrive, then 408"),
    body_timeout: float = typer.Option(30.0, help="seconds for a request's body to arrive, then 408"),
    keep_alive_timeout: float = typer.Option(5.0, help="seconds an idle keep-alive connection is held"),
) -> None:
    """Serve the OpenAI-compatible API. Exits 0 after SIGTERM/SIGINT (drained), 2 for a usage error, 3 if the
    engine died of a fatal fault."""
    from atlas.server.lifecycle import ServerSettings
    from atlas.server.security import RequestLimits
    from atlas.server.serve import serve as run_server

    settings = ServerSettings(max_connections=max_connections, header_timeout=header_timeout,
                              keep_alive_timeout=keep_alive_timeout, shutdown_grace=shutdown_grace,
                              requests=RequestLimits(body_timeout=body_timeout, max_concurrency=max_concurrency))
    code = run_server(model, host=host, port=port, trace=trace, api_key=api_key, backend=backend,
                      max_seq_len=max_seq_len, max_batch_size=max_batch_size, ring_slots=ring_slots,
                      loop_watchdog=loop_watchdog, num_drafts=num_drafts, drafter=drafter, threads=threads,
                      enable_fault_injection=enable_fault_injection, prefix_caching=prefix_caching,
                      api_key_file=api_key_file, allow_unauthenticated=allow_unauthenticated, settings=settings)
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
    api_key: str = typer.Option(None, help="the server's key (or --api-key-file, or ATLAS_API_KEY)"),
    api_key_file: str = typer.Option(None, help="read the server's key from this file's first line"),
    result_json: str = typer.Option(None, help="also write the figures to this JSON file"),
) -> None:
    """Load-test a server like vLLM's bench serve: TTFT, TPOT, ITL (p50/p99) and throughput. Stops at the first
    401/403 with one line."""
    import json

    from atlas.server.auth import AuthConfigError, resolve_api_key
    from atlas.server.bench import AuthRefused, BenchConfig, format_report
    from atlas.server.bench import bench_serve as run_bench

    try:
        key = resolve_api_key(api_key, api_key_file).api_key
    except AuthConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    cfg = BenchConfig(base_url=base_url or "", num_prompts=num_prompts, input_len=random_input_len,
                      output_len=random_output_len, request_rate=request_rate, max_concurrency=max_concurrency,
                      seed=seed, api_key=key)
    launch = None
    if base_url is None:
        launch = {"model": model, "backend": backend, "max_seq_len": max_seq_len, "max_batch_size": max_batch_size}
    try:
        result = run_bench(cfg, launch=launch)
    except AuthRefused as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(format_report(result, cfg))
    if result_json:
        with open(result_json, "w") as f:
            json.dump(result, f, indent=2)
    if result["failed"]:
        raise typer.Exit(1)


@app.command()
def generate(
    prompt: list[str] = typer.Option(..., "--prompt", help="a prompt; repeat for several"),
    model: str = typer.Option("atlas-tiny", help="checkpoint directory, or the built-in atlas-tiny"),
    backend: str = typer.Option("cpu", help="cpu | cuda | cuda-fp32 | null"),
    max_tokens: int = typer.Option(None, help="default: what max_seq_len leaves"),
    temperature: float = typer.Option(0.0),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    seed: int = typer.Option(0),
    stop: list[str] = typer.Option(None, "--stop", help="a stop string; repeat for several"),
    ignore_eos: bool = typer.Option(False),
    max_seq_len: int = typer.Option(1024),
    max_batch_size: int = typer.Option(16),
    prefill_chunk_tokens: int = typer.Option(256),
    num_drafts: int = typer.Option(0, help="speculative decoding: drafts per verify (0 = off)"),
    drafter: str = typer.Option("mtp", help="mtp | ngram"),
    prefix_caching: bool = typer.Option(None, "--prefix-caching/--no-prefix-caching",
                                        help="reuse KV + recurrent state of shared prefixes (default: on for cpu)"),
    trace: str = typer.Option(None, help="record the run: a SQLite path or a SQLAlchemy URL"),
) -> None:
    """Generate from prompts with the engine (greedy by default) and print each completion."""
    import sys

    import structlog
    from rich.console import Console
    from rich.progress import Progress

    from atlas.config import EngineConfig
    from atlas.engine.engine import Engine
    from atlas.engine.offline import generate as run_generate
    from atlas.engine.sampling import SamplingParams

    class _Stderr:  # resolved at each write, so a replaced sys.stderr (tests, redirection) is followed
        def write(self, text: str) -> int:
            return sys.stderr.write(text)

        def flush(self) -> None:
            sys.stderr.flush()

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(_Stderr()))  # stdout is the completions
    config = EngineConfig(max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                          prefill_chunk_tokens=max(prefill_chunk_tokens, max_batch_size), num_drafts=num_drafts,
                          drafter=drafter,
                          enable_prefix_caching=backend == "cpu" if prefix_caching is None else prefix_caching)
    engine = Engine.from_model(model, backend=backend, config=config, trace=trace)  # type: ignore[arg-type]
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed,
                            stop=tuple(stop or ()), ignore_eos=ignore_eos)
    console = Console(stderr=True)
    try:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("generating", total=len(prompt))
            results = run_generate(engine, [engine.tokenizer.encode(p) for p in prompt], params,
                                   progress=lambda done, total: bar.update(task, completed=done))
    finally:
        events = engine.stats().trace_events_written
        engine.close()
    for p, r in zip(prompt, results, strict=True):
        typer.echo(f"--- {p!r} -> {len(r.token_ids)} tokens, finish_reason={r.finish_reason.value} "
                   f"({r.finish_detail})")
        typer.echo(r.text)
    if trace:
        console.print(f"trace: {trace} ({events} events)")


trace_app = typer.Typer(no_args_is_help=True, help="Inspect recorded traces.")
app.add_typer(trace_app, name="trace")
replay_app = typer.Typer(no_args_is_help=True, help="Replay recorded traces.")
app.add_typer(replay_app, name="replay")


@trace_app.command("show")
def trace_show(file: str, run_id: int = typer.Option(None, help="default: the last run in the store")) -> None:
    """Run summary, per-request outcome and event counts of a trace."""
    from rich.console import Console
    from rich.table import Table

    from atlas.replay.summary import summarize

    s = summarize(file, run_id)
    console = Console()
    r = s.run
    console.print(f"run {r.run_id}: atlas {r.engine_version} (git {r.git_revision or '?'}), model {r.model} "
                  f"[{r.model_fingerprint[:16]}], backend {r.backend}")
    console.print(f"config: {r.config}")
    console.print(f"{s.events} events over {s.steps} steps; outcomes: {s.outcome_counts}")
    if s.end is not None and s.end.truncated:  # a killed run: say so before anything that looks complete
        console.print(s.end.describe(), style="bold red", markup=False)
    for fault in s.faults:
        console.print(f"[red]{fault}[/red]")
    if s.speculation:
        sp = s.speculation
        console.print(f"speculation: {sp['verify_steps']} verifies, {sp['tokens_per_verify']} tokens per verify, "
                      f"{sp['drafts_accepted']}/{sp['drafts_proposed']} drafts accepted, p1 {sp['p1']}, "
                      f"by position unconditional {sp['p_unconditional']} conditional {sp['p_conditional']}, "
                      f"latched off {sp['latched_off']}")
    if s.prefix:
        px = s.prefix
        console.print(f"prefix cache: {px.get('hits', 0)} hits, {px.get('tokens_saved', 0)} prefill tokens saved "
                      f"({px.get('tokens_replayed', 0)} replayed), {px.get('snapshotted', 0)} snapshots; drafter carry: "
                      f"{px.get('carry_stored', 0)} stored, {px.get('carry_adopted', 0)} adopted "
                      f"({px.get('carry_rows_kept', 0)} rows kept, {px.get('carry_rows_appended', 0)} appended), "
                      f"{px.get('carry_released', 0)} released")
        for q in s.requests:
            if q.prefix_cached:
                console.print(f"  {q.request_id}: resumed at {q.prefix_cached} of {q.prompt_tokens} prompt tokens, "
                              f"{q.carry_rows} drafter rows carried")
    table = Table("request", "seq", "prompt", "completion", "arrived", "finished", "preempted", "finish", "detail")
    for q in s.requests:
        table.add_row(q.request_id, str(q.seq_id), str(q.prompt_tokens), str(q.completion_tokens),
                      str(q.arrival_step), "-" if q.finish_step is None else str(q.finish_step), str(q.preemptions),
                      q.finish_reason or "unfinished", q.finish_detail)
    console.print(table)
    counts = Table("event kind", "count")
    for kind, n in s.event_counts.items():
        counts.add_row(kind, str(n))
    console.print(counts)


@replay_app.command("verify")
def replay_verify(
    file: str,
    run_id: int = typer.Option(None, help="default: the last run in the store"),
    audit: bool = typer.Option(False, help="also audit every state machine in full after every event"),
) -> None:
    """Re-drive a trace's inputs through a fresh engine; exit 1 at the first divergent event."""
    from rich.console import Console
    from rich.progress import Progress

    from atlas.replay.summary import run_end
    from atlas.replay.verify import verify

    console = Console(stderr=True)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("replaying", total=None)
        report = verify(file, run_id, progress=lambda done, total: bar.update(task, completed=done, total=total),
                        engine_kwargs={"full_audit": audit})
    if not report.fingerprint_matches:
        typer.echo(f"warning: model fingerprint {report.fingerprint[:16]} differs from the trace's "
                   f"{report.run.model_fingerprint[:16]}")
    end = run_end(file, run_id)
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
def replay_check(file: str, run_id: int = typer.Option(None, help="default: the last run in the store")) -> None:
    """State-only replay: apply the trace's events to the state machines (no model), checking every invariant
    and digest; exit 1 at the first problem."""
    from atlas.replay.summary import run_end
    from atlas.replay.verify import check_state_only

    report = check_state_only(file, run_id)
    end = run_end(file, run_id)
    if end.truncated:  # the events on disk may be consistent, but the run did not end there
        typer.echo(f"{end.describe()}; the events on disk are "
                   f"{'consistent' if report.problem is None else 'inconsistent: ' + str(report.problem)}")
        raise typer.Exit(1)
    if report.problem is None:
        typer.echo(f"consistent: {report.events} events applied, every invariant and digest holds")
        return
    typer.echo(f"event {report.index}: {report.problem}")
    raise typer.Exit(1)


@bench_app.command("gpu")
def bench_gpu(
    config: str = typer.Option(None, help="model config.json (default: benchmarks/configs/qwen4exp-2p7b.json)"),
    out: str = typer.Option(None, help="directory for bench.json and the decode profile"),
    transformers: bool = typer.Option(True, help="also measure transformers on the same config"),
) -> None:
    """The CUDA backend on a GPU with random bf16 weights: prefill 2048, decode at batch 1/16/64, floors,
    the control plane's share, and transformers on the same config (see docs/BENCHMARKS.md)."""
    from pathlib import Path

    from atlas.bench import DEFAULT_CONFIG, run, table

    target = Path(out) if out else None
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
    typer.echo(table(run(Path(config) if config else DEFAULT_CONFIG, out=target, with_transformers=transformers)))


from atlas.replay.commands import register as _register_replay_commands  # noqa: E402 (after the sub-apps)

_register_replay_commands(trace_app, replay_app)


def main() -> None:
    app()
