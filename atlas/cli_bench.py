"""The `atlas bench ...` commands (registered by atlas.cli): `bench serve` load-tests a server, `bench gpu`
measures the CUDA backend on a GPU."""

from __future__ import annotations

import typer

from atlas.cli_checks import (
    SERVE_BACKENDS,
    TINY_MODEL,
    UsageError,
    check_backend,
    check_base_url,
    check_model,
    check_trace_out,
)


def register(bench_app: typer.Typer) -> None:
    """Add the bench commands to `atlas bench`."""

    @bench_app.command("serve")
    def bench_serve(
        base_url: str = typer.Option(None, help="a running server (default: start one in-process)"),
        model: str = typer.Option(None, help="in-process server: checkpoint directory or atlas-mini "
                                             "(default: atlas-tiny)"),
        backend: str = typer.Option("cpu", help="in-process server: cpu | cuda | null"),
        max_seq_len: int = typer.Option(None, help="in-process server: as for serve"),
        max_batch_size: int = typer.Option(None, help="in-process server: as for serve"),
        num_prompts: int = typer.Option(100, help="requests to send"),
        random_input_len: int = typer.Option(64, help="prompt tokens per request"),
        random_output_len: int = typer.Option(32, help="completion tokens per request (ignore_eos)"),
        request_rate: float = typer.Option(float("inf"), help="requests/s (Poisson); inf sends all at once"),
        max_concurrency: int = typer.Option(None, help="requests in flight at most (default: unbounded)"),
        seed: int = typer.Option(0, help="prompt seed"),
        api_key: str = typer.Option(None, help="the server's key (or --api-key-file, or ATLAS_API_KEY)"),
        api_key_file: str = typer.Option(None, help="read the server's key from this file's first line"),
        result_json: str = typer.Option(None, help="also write the figures to this JSON file"),
        threads: int = typer.Option(None, help="in-process server: torch CPU threads (as for serve)"),
        progress: bool = typer.Option(True, help="show requests done on stderr"),
    ) -> None:
        """Load-test a server like vLLM's bench serve: TTFT, TPOT, ITL (p50/p99) and throughput. Stops at the first
        401/403 with one line."""
        import json

        from atlas.cli_support import progress_bar
        from atlas.server.auth import AuthConfigError, resolve_api_key
        from atlas.server.bench import AuthRefused, BenchConfig, ServerUnreachable, format_report
        from atlas.server.bench import bench_serve as run_bench

        try:
            key = resolve_api_key(api_key, api_key_file).api_key
        except AuthConfigError as exc:
            raise UsageError(str(exc)) from None

        if base_url is not None:
            check_base_url(base_url)
        if base_url is None:
            from atlas.cli_checks import default_max_seq_len

            check_backend(backend, SERVE_BACKENDS)
            check_model(model or TINY_MODEL)
            max_seq_len = default_max_seq_len(model, max_seq_len) if model else max_seq_len
        if result_json:
            check_trace_out(result_json, knob="--result-json", store=False)
        cfg = BenchConfig(base_url=base_url or "", num_prompts=num_prompts, input_len=random_input_len,
                          output_len=random_output_len, request_rate=request_rate, max_concurrency=max_concurrency,
                          seed=seed, api_key=key)
        launch = None
        if base_url is None:
            launch = {"model": model, "backend": backend, "max_seq_len": max_seq_len, "max_batch_size": max_batch_size}
        try:
            with progress_bar("requests", num_prompts, enabled=progress) as update:
                result = run_bench(cfg, launch=launch, progress=update, threads=threads)
        except AuthRefused as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except ServerUnreachable as exc:
            raise UsageError(str(exc)) from None
        typer.echo(format_report(result, cfg))
        if result_json:
            try:
                with open(result_json, "w") as f:
                    json.dump(result, f, indent=2)
            except OSError as exc:  # a full disk: the report above stands, the file is named
                raise UsageError(f"--result-json {result_json!r} cannot be written ({exc.strerror or exc})") from None
        if result["failed"]:
            raise typer.Exit(1)

    @bench_app.command("gpu")
    def bench_gpu(
        config: str = typer.Option(None, help="model config.json (default: benchmarks/configs/qwen4exp-2p7b.json)"),
        out: str = typer.Option(None, help="directory for bench.json and the decode profile"),
        transformers: bool = typer.Option(True, help="also measure transformers on the same config"),
    ) -> None:
        """The CUDA backend on a GPU with random bf16 weights: prefill 2048, decode at batch 1/16/64, floors,
        the control plane's share, and transformers on the same config (docs/PERFORMANCE.md)."""
        from pathlib import Path

        import torch

        if config is not None and not Path(config).is_file():
            raise UsageError(f"--config {config!r} does not exist; pass a model config.json")
        if not torch.cuda.is_available():
            raise UsageError(f"atlas bench gpu needs a CUDA GPU and torch {torch.__version__} sees none; run it on the "
                             "GPU machine (bash benchmarks/gpu_run.sh)")
        from atlas.bench import DEFAULT_CONFIG, run, table

        target = Path(out) if out else None
        if target is not None:
            target.mkdir(parents=True, exist_ok=True)
        typer.echo(table(run(Path(config) if config else DEFAULT_CONFIG, out=target, with_transformers=transformers)))
