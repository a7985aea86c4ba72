"""Running the server: `atlas serve`, and a background-thread server for tests and benchmarks."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import structlog
import uvicorn

from atlas.model.loader import model_dir
from atlas.registry import build_engine as registry_build
from atlas.server.app import DEFAULT_MAX_HEADER_BYTES, create_app
from atlas.server.chat import load_chat_template
from atlas.server.engine_loop import EngineLoop

log = structlog.get_logger(__name__)

EXIT_BAD_CONFIG = 2
EXIT_ENGINE_DEAD = 3
DEATH_GRACE_S = 1.0  # keep answering 503 this long after a fatal fault, so probes and clients see why
DEATH_HARD_EXIT_S = 15.0  # if a graceful stop hangs (a stuck connection), leave anyway: dead is dead


def _uvicorn_config(app: Any, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        # h11 bounds what it buffers while parsing headers: a backstop above the app's own 431 limit
        http="h11",
        h11_max_incomplete_event_size=4 * DEFAULT_MAX_HEADER_BYTES,
        lifespan="off",
        log_level=log_level,
        timeout_graceful_shutdown=2,
        access_log=False,
    )


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
) -> Any:
    from atlas.config import EngineConfig

    knobs = {"max_seq_len": max_seq_len, "max_batch_size": max_batch_size, "ring_slots": ring_slots,
             "loop_watchdog": loop_watchdog or None, "num_drafts": num_drafts, "drafter": drafter,
             # prefix caching: on by default where the backend stores prefix snapshots (cpu)
             "enable_prefix_caching": backend == "cpu" if prefix_caching is None else prefix_caching}
    config = EngineConfig(**{k: v for k, v in knobs.items() if v is not None})
    return registry_build(model or "atlas-tiny", backend, config, trace=trace)


class ServerThread:
    """uvicorn serving an app on a free loopback port from a background thread."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0) -> None:
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and
        # without it every second write of a response waits ~40 ms for a delayed ACK (Nagle)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        self.server = uvicorn.Server(_uvicorn_config(app, self.host, self.port, "warning"))
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

    def stop(self, timeout: float = 10.0) -> None:
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


@contextmanager
def serve_in_thread(engine: Any, **app_options: Any) -> Iterator[Served]:
    """An engine behind a live loopback server for the block's duration (tests, benchmarks)."""
    engine_loop = EngineLoop(engine).start()
    try:
        app = create_app(engine_loop, **app_options)
        with ServerThread(app) as server:
            yield Served(server.url, app, engine_loop)
    finally:
        engine_loop.stop()


class _StoppingServer(uvicorn.Server):
    """Stops the engine loop (closing the trace) as part of shutdown: uvicorn re-raises SIGTERM/SIGINT
    once it has shut down, and the default handler would end the process before a `finally` ran."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop) -> None:
        super().__init__(config)
        self._engine_loop = engine_loop

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        self._engine_loop.stop()


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
) -> int:
    """Serve until stopped. Returns the process exit status: 0, EXIT_BAD_CONFIG when the engine cannot be
    built (the reason is logged), or EXIT_ENGINE_DEAD after a fatal fault."""
    set_engine_threads(threads)
    try:
        engine = engine_for_serving(model, backend=backend, trace=trace, max_seq_len=max_seq_len,
                              max_batch_size=max_batch_size, ring_slots=ring_slots, loop_watchdog=loop_watchdog,
                              num_drafts=num_drafts, drafter=drafter, prefix_caching=prefix_caching)
    except (ValueError, OSError) as exc:  # CapacityError is a ValueError: it names the knob and numbers
        log.error("cannot start the engine", error=str(exc))
        return EXIT_BAD_CONFIG
    engine_loop = EngineLoop(engine).start()
    template = load_chat_template(model_dir(model) if model else None)  # "atlas-mini" -> models/atlas-mini
    app = create_app(engine_loop, chat_template=template, api_key=api_key,
                     enable_fault_injection=enable_fault_injection, model_name=served_model_name)
    server = _StoppingServer(_uvicorn_config(app, host, port, log_level), engine_loop)

    def on_death(detail: str) -> None:
        log.error("fatal engine fault: the server stops", detail=detail)
        threading.Timer(DEATH_GRACE_S, lambda: setattr(server, "should_exit", True)).start()
        hard_exit = threading.Timer(DEATH_HARD_EXIT_S, os._exit, args=(EXIT_ENGINE_DEAD,))
        hard_exit.daemon = True
        hard_exit.start()

    engine_loop.on_death(on_death)
    if enable_fault_injection:
        log.warning("fault injection is enabled: for tests only")
    log.info("serving", model=served_model_name or engine.model_name, url=f"http://{host}:{port}", backend=backend, trace=trace)
    try:
        server.run()
    finally:
        engine_loop.stop()  # already stopped by a clean shutdown; this covers a failed start
    if engine_loop.dead is not None:
        return EXIT_ENGINE_DEAD
    return 0
