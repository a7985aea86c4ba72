"""The `atlas` command.

Exit status: 0 success, 1 a check that failed (a divergent replay, failed requests), 2 a usage error (one
line on stderr naming the knob, the value and what to do), 3 a fatal engine fault. `--debug` (anywhere on the
line, or ATLAS_DEBUG=1) prints the traceback of an error instead of its one line. Logs go to stderr; stdout
carries only results.
"""

from __future__ import annotations

import os
import sys

import typer

from atlas.cli_checks import (
    SERVE_BACKENDS,
    TINY_MODEL,
    UsageError,
    check_backend,
    check_model,
    check_port,
    check_temp_dir,
    check_trace_out,
    check_tuning,
)

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, pretty_exceptions_enable=False,
                  help="Atlas: serve and replay hybrid LMs. Add --debug to any command for tracebacks.")

EXIT_USAGE = 2
EXIT_ENGINE_DEAD = 3
GENERATE_BACKENDS = SERVE_BACKENDS
DRAFTERS = ("mtp", "ngram")


class EngineFatal(Exception):
    """The engine died of a fatal fault while a command ran: exit status 3."""


def _print_version(value: bool) -> None:
    if value:
        from atlas import __version__

        typer.echo(__version__)
        raise typer.Exit(0)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="print tracebacks of errors (also ATLAS_DEBUG=1)"),
          version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="print the Atlas version and exit")) -> None:
    """Atlas: serve and replay hybrid LMs."""


@app.command()
def version() -> None:
    """Print the Atlas version."""
    from atlas import __version__

    typer.echo(__version__)


def _check_drafter(drafter: str | None) -> None:
    if drafter is not None and drafter not in DRAFTERS:
        raise UsageError(f"--drafter {drafter!r} is not a drafter; use mtp (the model's MTP head) or ngram "
                         "(prompt lookup)")


@app.command()
def serve(
    model_arg: str = typer.Argument(None, metavar="MODEL", show_default=False,
                                    help="checkpoint directory or atlas-mini, as vLLM's `serve MODEL` (or --model)"),
    model: str = typer.Option(None, help="checkpoint directory or atlas-mini (default: the built-in atlas-tiny)"),
    host: str = typer.Option("127.0.0.1", help="bind address (loopback unless told otherwise)"),
    port: int = typer.Option(8000, help="TCP port"),
    trace: str = typer.Option(None, help="trace store: a SQLite path or a SQLAlchemy URL"),
    api_key: str = typer.Option(None, help="require 'Authorization: Bearer KEY' (visible in ps: prefer "
                                "--api-key-file or the ATLAS_API_KEY variable; an empty key is an error)"),
    backend: str = typer.Option("cpu", help="cpu | cuda | cuda-fp32 | cuda-invariant | null"),
    tuning: str = typer.Option(None, help="CUDA backends: the kernels' arrangement: default (the fastest measured; "
                               "compiles on the first steps of each shape) | eager (plain torch, the reference "
                               "for debugging)"),
    max_seq_len: int = typer.Option(None, "--max-seq-len", "--max-model-len",
                                    help="longest prompt + completion, in tokens (default: 4096, or the model's "
                                         "max_position_embeddings when smaller)"),
    max_batch_size: int = typer.Option(None, "--max-batch-size", "--max-num-seqs",
                                       help="sequences decoded together (default: 64)"),
    prefill_align: int = typer.Option(None, help="prefill chunks end at multiples of this many prompt tokens, so "
                                      "a prompt's chunking does not depend on the load (0: off; default: derived "
                                      "for the batch-invariant backends, off elsewhere)"),
    loop_watchdog: bool = typer.Option(False, help="roll content loops back (non-streaming requests)"),
    ring_slots: int = typer.Option(None, help="boundary snapshots per sequence for rollback (0: declines)"),
    num_drafts: int = typer.Option(None, help="speculative decoding: drafts per verify (0: off)"),
    drafter: str = typer.Option(None, help="speculative drafter: mtp | ngram (default: mtp)"),
    prefix_caching: bool = typer.Option(None, "--prefix-caching/--no-prefix-caching",
                                        "--enable-prefix-caching/--no-enable-prefix-caching",
                                        help="reuse KV + recurrent state of shared prefixes (default: on for cpu, cuda)"),
    threads: int = typer.Option(None, help="torch CPU threads (default: OMP_NUM_THREADS, else 1: measured best, "
                                           "see atlas/threads.py)"),
    # -- vLLM's flags without an Atlas twin (atlas/cli_serve.py maps or refuses each) --
    dtype: str = typer.Option("auto", help="auto | bfloat16 | float32: picks the backend's mode (cuda + float32 -> "
                                           "cuda-fp32); one the backend has no mode for is an error"),
    seed: int = typer.Option(None, help="requests without a seed get theirs from this seed's sequence (recorded in "
                                        "the trace, per request and in the run)"),
    tensor_parallel_size: int = typer.Option(1, help="1: Atlas serves on one device; more is an error"),
    gpu_memory_utilization: float = typer.Option(None, hidden=True, help="refused: the KV cache is sized by "
                                                 "--max-model-len x --max-num-seqs"),
    metrics_auth: bool = typer.Option(False, "--metrics-auth", help="require the API key on /metrics too (default: open, as vLLM's, "
                                                  "so a Prometheus scrape needs no key)"),
    enable_fault_injection: bool = typer.Option(False, hidden=True, help="tests only: fault-injection hooks"),
    served_model_name: str = typer.Option(None, help="the model id clients send and /v1/models lists (default: "
                                                     "the checkpoint directory's name)"),
    tokenizer: str = typer.Option("auto", help="auto: the checkpoint's tokenizer.json (required); byte: the byte "
                                               "tokenizer, for a checkpoint without one"),
    # -- auth, shutdown and connection bounds (atlas/server/auth.py, lifecycle.py, connections.py) --
    api_key_file: str = typer.Option(None, help="read the API key from this file's first line"),
    allow_unauthenticated: bool = typer.Option(False, help="serve a non-loopback --host without an API key"),
    shutdown_grace: float = typer.Option(30.0, help="seconds in-flight requests get to finish on SIGTERM/SIGINT"),
    max_connections: int = typer.Option(None, help="open connections at most (default: the fd limit - 256)"),
    max_concurrency: int = typer.Option(4096, help="requests in flight at most (probes excepted), then 503"),
    header_timeout: float = typer.Option(10.0, help="seconds for a request's headers to arrive, then 408"),
    body_timeout: float = typer.Option(30.0, help="seconds for a request's body to arrive, then 408"),
    keep_alive_timeout: float = typer.Option(75.0, help="seconds an idle keep-alive connection is held "
                                             "(above the client pools' expiry: httpx 5, aiohttp 15)"),
) -> None:
    """Serve the OpenAI-compatible API. Exits 0 after SIGTERM/SIGINT (drained), 2 for a usage error, 3 if the
    engine died of a fatal fault. vLLM's flags work beside Atlas's (see atlas/cli_serve.py)."""
    from atlas.cli_serve import (
        check_gpu_memory_utilization,
        check_seed,
        check_tensor_parallel,
        resolve_dtype,
        resolve_model,
    )

    model = resolve_model(model_arg, model)
    check_tuning(tuning, backend)
    check_backend(backend, SERVE_BACKENDS)
    backend = resolve_dtype(dtype, backend)
    check_tensor_parallel(tensor_parallel_size, backend)
    check_gpu_memory_utilization(gpu_memory_utilization)
    check_seed(seed)
    _check_drafter(drafter)
    check_model(model or TINY_MODEL, tokenizer)
    check_trace_out(trace)
    check_port(host, port)
    from atlas.cli_checks import default_max_seq_len
    from atlas.server.lifecycle import ServerSettings
    from atlas.server.security import RequestLimits
    from atlas.server.serve import serve as run_server

    settings = ServerSettings(max_connections=max_connections, header_timeout=header_timeout,
                              keep_alive_timeout=keep_alive_timeout, shutdown_grace=shutdown_grace,
                              requests=RequestLimits(body_timeout=body_timeout, max_concurrency=max_concurrency))
    max_seq_len = default_max_seq_len(model or TINY_MODEL, max_seq_len) if model else max_seq_len
    code = run_server(model, host=host, port=port, trace=trace, api_key=api_key, backend=backend,
                      max_seq_len=max_seq_len, max_batch_size=max_batch_size, ring_slots=ring_slots,
                      loop_watchdog=loop_watchdog, num_drafts=num_drafts, drafter=drafter, threads=threads,
                      enable_fault_injection=enable_fault_injection, prefix_caching=prefix_caching,
                      served_model_name=served_model_name, api_key_file=api_key_file,
                      allow_unauthenticated=allow_unauthenticated, settings=settings, prefill_align=prefill_align,
                      tuning=tuning, seed=seed, metrics_auth=metrics_auth)
    raise typer.Exit(code)


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks.")
app.add_typer(bench_app, name="bench")


@app.command()
def generate(
    prompt: list[str] = typer.Option(..., "--prompt", help="a prompt; repeat for several"),
    model: str = typer.Option(TINY_MODEL, help="checkpoint directory, atlas-mini, or the built-in atlas-tiny"),
    backend: str = typer.Option("cpu", help="cpu | cuda | cuda-fp32 | cuda-invariant | null"),
    max_tokens: int = typer.Option(16, help="completion tokens per prompt, at most (16, as vLLM's and OpenAI's "
                                            "completions default)"),
    temperature: float = typer.Option(0.0, help="0: greedy"),
    top_p: float = typer.Option(1.0, help="nucleus sampling mass"),
    top_k: int = typer.Option(0, help="0: off"),
    seed: int = typer.Option(0, help="sampling seed"),
    stop: list[str] = typer.Option(None, "--stop", help="a stop string; repeat for several"),
    ignore_eos: bool = typer.Option(False, help="keep generating past the end-of-sequence token"),
    max_seq_len: int = typer.Option(None, help="longest prompt + completion (default: 1024, or the model's "
                                               "max_position_embeddings when smaller)"),
    max_batch_size: int = typer.Option(16, help="sequences decoded together"),
    prefill_chunk_tokens: int = typer.Option(256, help="tokens per step, all sequences together"),
    prefill_align: int = typer.Option(None, help="prefill chunks end at multiples of this many prompt tokens, so "
                                      "a prompt's chunking does not depend on the load (0: off; default: derived "
                                      "for the batch-invariant backends, off elsewhere)"),
    num_drafts: int = typer.Option(0, help="speculative decoding: drafts per verify (0: off)"),
    drafter: str = typer.Option("mtp", help="mtp | ngram"),
    prefix_caching: bool = typer.Option(None, "--prefix-caching/--no-prefix-caching",
                                        help="reuse KV + recurrent state of shared prefixes (default: on for cpu, cuda)"),
    trace: str = typer.Option(None, help="record the run: a SQLite path or a SQLAlchemy URL"),
    threads: int = typer.Option(None, help="torch CPU threads (default: OMP_NUM_THREADS, else 1)"),
    tokenizer: str = typer.Option("auto", help="auto: the checkpoint's tokenizer.json; byte: for one without"),
) -> None:
    """Generate from prompts with the engine (greedy by default) and print each completion."""
    check_backend(backend, GENERATE_BACKENDS)
    _check_drafter(drafter)
    check_model(model, tokenizer)
    check_trace_out(trace)
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}")
    from atlas.cli_checks import default_max_seq_len
    from atlas.cli_support import progress_bar
    from atlas.threads import apply_threads

    apply_threads(threads)
    max_seq_len = default_max_seq_len(model, max_seq_len, fallback=1024)
    from rich.console import Console

    from atlas.config import EngineConfig
    from atlas.engine.offline import generate as run_generate
    from atlas.errors import EngineDead
    from atlas.sampling.params import SamplingParams

    config = EngineConfig(max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                          prefill_chunk_tokens=max(prefill_chunk_tokens, max_batch_size), num_drafts=num_drafts,
                          drafter=drafter, prefill_align=prefill_align,
                          enable_prefix_caching=backend != "null" if prefix_caching is None else prefix_caching)
    from atlas.registry import build_engine

    engine = _open_engine(lambda: build_engine(model, backend, config, trace=trace), trace)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed,
                            stop=tuple(stop or ()), ignore_eos=ignore_eos)
    try:
        with progress_bar("generating", len(prompt)) as update:
            results = run_generate(engine, [engine.tokenizer.encode(p) for p in prompt], params, progress=update)
    except EngineDead as exc:
        raise EngineFatal(str(exc)) from exc
    finally:
        events = engine.stats().trace_events_written
        engine.close()
    for p, r in zip(prompt, results, strict=True):
        typer.echo(f"--- {p!r} -> {len(r.token_ids)} tokens, finish_reason={r.finish_reason.value} "
                   f"({r.finish_detail})")
        typer.echo(r.text)
    if trace:
        Console(stderr=True).print(f"trace: {trace} ({events} events)", markup=False)


def _open_engine(build, trace: str | None):  # type: ignore[no-untyped-def]
    """Build an engine; a trace path SQLite cannot open becomes a usage error naming the path."""
    from sqlalchemy.exc import OperationalError

    try:
        return build()
    except OperationalError as exc:
        if trace is None:
            raise
        raise UsageError(f"--trace {trace!r} cannot be opened for writing ({exc.orig}); pick a path in a directory "
                         "you can write to") from exc


trace_app = typer.Typer(no_args_is_help=True, help="Inspect recorded traces.")
app.add_typer(trace_app, name="trace")
replay_app = typer.Typer(no_args_is_help=True, help="Replay recorded traces.")
app.add_typer(replay_app, name="replay")

from atlas.cli_bench import register as _register_bench_commands  # noqa: E402 (after the sub-apps)
from atlas.replay.commands import register as _register_replay_commands  # noqa: E402 (after the sub-apps)

_register_bench_commands(bench_app)
_register_replay_commands(trace_app, replay_app)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def run(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (errors already reported on stderr)."""
    from atlas.cli_support import logs_to_stderr, plain_metavars

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("ATLAS_DEBUG") == "1"
    args = [a for a in args if a != "--debug"]
    logs_to_stderr()
    command = typer.main.get_command(app)
    plain_metavars(command)
    try:
        check_temp_dir()
        rc = command.main(args=args, prog_name="atlas", standalone_mode=False)
    except typer.Abort:
        print("atlas: interrupted", file=sys.stderr)
        return 130
    except typer.TyperException as exc:  # the parser's own: a missing option, a non-integer, an unknown flag
        if type(exc).__name__ == "NoArgsIsHelpError":  # `atlas trace` alone: the help, as click shows it
            exc.show()  # type: ignore[attr-defined]
            return int(getattr(exc, "exit_code", EXIT_USAGE))
        if debug:
            raise
        ctx = getattr(exc, "ctx", None)
        where = getattr(ctx, "command_path", None) or "atlas"
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        print(f"{where}: {_one_line(message)} (see {where} --help)", file=sys.stderr)
        return int(getattr(exc, "exit_code", EXIT_USAGE))
    except Exception as exc:
        if debug:
            raise
        return _report(exc)
    return rc if isinstance(rc, int) else 0


def _report(exc: Exception) -> int:
    from atlas.config import CapacityError
    from atlas.errors import TraceFileError
    from atlas.model.spec import ModelLoadError
    from atlas.threads import ThreadsError

    if isinstance(exc, UsageError | CapacityError | ModelLoadError | ThreadsError | TraceFileError):
        print(f"atlas: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, OSError) and exc.filename is not None:  # a file the command reads or writes: a full disk,
        print(f"atlas: {exc.filename}: {exc.strerror or _one_line(exc)}", file=sys.stderr)  # no permission
        return EXIT_USAGE
    if isinstance(exc, EngineFatal):
        print(f"atlas: fatal engine fault: {_one_line(exc)} (the trace, if any, holds every event up to it)",
              file=sys.stderr)
        return EXIT_ENGINE_DEAD
    if isinstance(exc, LookupError) and "trace" in str(exc):  # the store's "no run N" / "holds no run"
        hint = "; pass --run-id with one of them" if "runs:" in str(exc) else ""
        print(f"atlas: {_one_line(exc)}{hint}", file=sys.stderr)
        return EXIT_USAGE
    print(f"atlas: internal error: {type(exc).__name__}: {_one_line(exc)} (rerun with --debug for the traceback)",
          file=sys.stderr)
    return 1


def main() -> None:
    sys.exit(run())
