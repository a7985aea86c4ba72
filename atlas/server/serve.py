"""Running the server: `atlas serve`, and a background-thread server for tests and benchmarks."""

from __future__ import annotations

import gc
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import structlog

from atlas.model.loader import model_dir
from atlas.registry import build_engine as registry_build
from atlas.server.app import create_app
from atlas.server.auth import AuthConfigError, AuthSettings, check_exposure, is_loopback, resolve_api_key
from atlas.server.chat import load_chat_template
from atlas.server.engine_loop import EngineLoop
from atlas.server.lifecycle import AtlasServer, ServerSettings, uvicorn_config
from atlas.server.logconfig import REDACTOR, configure_logging
from atlas.server.security import Lifecycle

log = structlog.get_logger(__name__)

EXIT_BAD_CONFIG = 2
EXIT_ENGINE_DEAD = 3
DEATH_GRACE_S = 1.0  # keep answering 503 this long after a fatal fault, so probes and clients see why
DEATH_HARD_EXIT_S = 15.0  # if a graceful stop hangs (a stuck connection), leave anyway: dead is dead


def set_engine_threads(threads: int | None = None) -> int:
    """Size torch's intra-op pool for the engine by the one policy of atlas/threads.py (explicit, else
    OMP_NUM_THREADS, else 1). Measured for serving on a shared 2-core machine (atlas-tiny, bench serve 16
    prompts of 128 -> 64 tokens, 4 concurrent, 4 interleaved rounds): 1 thread gave 68/109/108/89 output
    tok/s against 57/74/73/79 with torch's default 2, whose workers spin against the event loop and the
    engine thread.
    """
    from atlas.threads import apply_threads

    return apply_threads(threads)


def engine_for_serving(
    model: str | None,
    *,
    backend: str = "cpu",
    trace: str | None = None,
    max_seq_len: int | None = None,
    max_batch_size: int | None = None,
    ring_slots: int | None = None,
    loop_watchdog: bool = False,
    num_drafts: int | None = None,
    drafter: str | None = None,
    prefix_caching: bool | None = None,
    prefill_align: int | None = None,
    tuning: str | None = None,
    seed: int | None = None,
) -> Any:
    """`tuning`: a CUDA backend's arrangement name (atlas.backends.cuda.tuning.TUNINGS; the trace records its knobs,
    so a replay rebuilds the same arithmetic). `seed`: the default seed, recorded in the trace's run row."""
    from atlas.config import EngineConfig

    knobs = {"max_seq_len": max_seq_len, "max_batch_size": max_batch_size, "ring_slots": ring_slots,
             "loop_watchdog": loop_watchdog or None, "num_drafts": num_drafts, "drafter": drafter,
             "prefill_align": prefill_align,
             # prefix caching: on by default where the backend stores prefix snapshots (cpu, cuda)
             "enable_prefix_caching": backend != "null" if prefix_caching is None else prefix_caching}
    config = EngineConfig(**{k: v for k, v in knobs.items() if v is not None})
    options = None
    if tuning is not None:
        from atlas.registry import TUNINGS

        options = {"tuning": TUNINGS[tuning]}
        log.info("CUDA tuning", tuning=tuning, knobs=attrs.asdict(TUNINGS[tuning]))
    return registry_build(model or "atlas-tiny", backend, config, trace=trace, backend_options=options, seed=seed)


class ServerThread:
    """uvicorn serving an app on a free loopback port from a background thread (no signals there: `stop` is
    the shutdown, with the same drain as a SIGTERM)."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0,
                 settings: ServerSettings | None = None) -> None:
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
        # without it every second write of a response waits ~40 ms for a delayed ACK (Nagle)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        settings = settings or ServerSettings(shutdown_grace=0.0)
        config = uvicorn_config(app, self.host, self.port, "warning", settings)
        self.server = AtlasServer(config, app.state.engine_loop, app.state.lifecycle, settings.shutdown_grace)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@attrs.frozen
class Served:
    url: str
    app: Any
    engine_loop: EngineLoop
    server: ServerThread


@contextmanager
def serve_in_thread(engine: Any, *, settings: ServerSettings | None = None, **app_options: Any) -> Iterator[Served]:
    """An engine behind a live loopback server for the block's duration (tests, benchmarks)."""
    engine_loop = EngineLoop(engine).start()
    try:
        if settings is not None:
            app_options.setdefault("limits", settings.requests)
        app = create_app(engine_loop, **app_options)
        with ServerThread(app, settings=settings) as server:
            yield Served(server.url, app, engine_loop, server)
    finally:
        engine_loop.stop()


def startup_auth(host: str, api_key: str | None, api_key_file: str | None, allow_unauthenticated: bool
                 ) -> AuthSettings:
    """The key and the exposure rules (auth.py); AuthConfigError names the flag."""
    auth = resolve_api_key(api_key, api_key_file)
    check_exposure(host, auth, allow_unauthenticated)
    REDACTOR.add(auth.api_key)
    return auth


def serve(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    trace: str | None = None,
    api_key: str | None = None,
    backend: str = "cpu",
    max_seq_len: int | None = None,
    max_batch_size: int | None = None,
    ring_slots: int | None = None,
    loop_watchdog: bool = False,
    num_drafts: int | None = None,
    drafter: str | None = None,
    threads: int | None = None,
    enable_fault_injection: bool = False,
    log_level: str = "info",
    prefix_caching: bool | None = None,
    served_model_name: str | None = None,
    api_key_file: str | None = None,
    allow_unauthenticated: bool = False,
    settings: ServerSettings | None = None,
    prefill_align: int | None = None,
    tuning: str | None = None,
    seed: int | None = None,
    metrics_auth: bool = False,
) -> int:
    """Serve until stopped. Returns the process exit status: 0 (also after SIGTERM/SIGINT: drained),
    EXIT_BAD_CONFIG when the engine cannot be built or the flags are wrong (the reason is logged), or
    EXIT_ENGINE_DEAD after a fatal fault."""
    configure_logging(log_level)
    settings = settings or ServerSettings()
    try:
        auth = startup_auth(host, api_key, api_key_file, allow_unauthenticated)
    except AuthConfigError as exc:
        log.error("cannot start the server", error=str(exc))
        return EXIT_BAD_CONFIG
    set_engine_threads(threads)
    try:
        engine = engine_for_serving(model, backend=backend, trace=trace, max_seq_len=max_seq_len,
                              max_batch_size=max_batch_size, ring_slots=ring_slots, loop_watchdog=loop_watchdog,
                              num_drafts=num_drafts, drafter=drafter, prefix_caching=prefix_caching,
                              prefill_align=prefill_align, tuning=tuning, seed=seed)
    except (ValueError, OSError) as exc:  # CapacityError is a ValueError: it names the knob and numbers
        log.error("cannot start the engine", error=str(exc))
        return EXIT_BAD_CONFIG
    engine_loop = EngineLoop(engine).start()
    template = load_chat_template(model_dir(model) if model else None)  # "atlas-mini" -> models/atlas-mini
    lifecycle = Lifecycle()
    app = create_app(engine_loop, chat_template=template, api_key=auth.api_key, limits=settings.requests,
                     lifecycle=lifecycle, enable_fault_injection=enable_fault_injection, model_name=served_model_name,
                     default_seed=seed, metrics_auth=metrics_auth)
    config = uvicorn_config(app, host, port, log_level, settings)
    server = AtlasServer(config, engine_loop, lifecycle, settings.shutdown_grace)

    def on_death(detail: str) -> None:
        log.error("fatal engine fault: the server stops", detail=detail)
        threading.Timer(DEATH_GRACE_S, lambda: setattr(server, "should_exit", True)).start()
        hard_exit = threading.Timer(DEATH_HARD_EXIT_S, os._exit, args=(EXIT_ENGINE_DEAD,))
        hard_exit.daemon = True
        hard_exit.start()

    engine_loop.on_death(on_death)
    if enable_fault_injection:
        log.warning("fault injection is enabled: for tests only")
    if auth.source == "--api-key":
        log.warning("the API key is on the command line, where `ps` shows it to every local user; "
                    "prefer --api-key-file PATH or ATLAS_API_KEY")
    if not auth.enabled:
        log.warning("auth is OFF: every route answers without a key", host=host,
                    reachable="from this machine only" if is_loopback(host)
                    else "from the network (--allow-unauthenticated)")
    limits = settings.requests
    log.info("serving", model=served_model_name or engine.model_name, url=f"http://{host}:{port}", backend=backend, trace=trace,
             auth=f"on ({auth.source})" if auth.enabled else "off", host=host, seed=seed,
             metrics="behind the key" if auth.enabled and metrics_auth else "open",
             max_connections=config.http.limits.max_connections,  # type: ignore[union-attr]
             max_concurrency=limits.max_concurrency, header_timeout_s=settings.header_timeout,
             body_timeout_s=limits.body_timeout, keep_alive_s=settings.keep_alive_timeout,
             shutdown_grace_s=settings.shutdown_grace)
    # The model, torch and everything loaded so far never become garbage: frozen out of the collector's sight;
    # and a young generation of 100k objects, not 700: a flood of connections no longer triggers a collection
    # every few accepts. Measured (10,000 connections opened against `serve --backend null`, server CPU per
    # accepted connection, loaded 2-core machine): 101-114 us with Python's defaults, 68-82 us with these.
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 50)
    try:
        server.run()
    finally:
        engine_loop.stop()  # already stopped by a clean shutdown; this covers a failed start
    if engine_loop.dead is not None:
        return EXIT_ENGINE_DEAD
    return 0
