"""No secret in a log: a client that disconnects mid-body is a normal event (no traceback, no locals), the key
never reaches the logs or argv, and /health stays fast while it happens 200 times."""

from __future__ import annotations

import io
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import structlog
from fixtures.serving import ServeProcess

from atlas.server.logconfig import REDACTOR, Redactor, configure_logging

KEY = "sk-atlas-test-5f1c0e9a7b3d4e2f"


def _mid_body_disconnect(port: int, key: str) -> None:
    """Declares 100 bytes of body, sends 12, and goes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: 100\r\n\r\n" + b'{"prompt": "')


def test_mid_body_disconnects_leak_nothing_and_health_stays_fast(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    with ServeProcess(tmp_path, "--backend", "null", "--api-key-file", str(key_file)) as server:
        server.wait_ready()
        assert KEY not in Path(f"/proc/{server.pid}/cmdline").read_bytes().decode(errors="replace")
        worst = [0.0]
        failures: list[str] = []
        done = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=server.url, timeout=5) as http:
                while not done.is_set():
                    started = time.monotonic()
                    try:
                        status = http.get("/health").status_code
                    except httpx.HTTPError as exc:
                        failures.append(repr(exc))
                        status = 0
                    worst[0] = max(worst[0], time.monotonic() - started)
                    if status != 200:
                        failures.append(f"/health {status}")
                    time.sleep(0.02)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            for _ in range(200):
                _mid_body_disconnect(server.port, KEY)
        finally:
            time.sleep(0.5)  # the last disconnects are handled while the probe still runs
            done.set()
            prober.join()
        assert not failures, failures[:5]
        assert worst[0] < 1.0, f"/health took {worst[0]:.2f} s during the disconnects"
        r = httpx.post(f"{server.url}/v1/completions", headers={"authorization": f"Bearer {KEY}"},
                       json={"prompt": "still fine", "max_tokens": 3}, timeout=10)
        assert r.status_code == 200
        server.signal(signal.SIGTERM)
        assert server.wait() == 0
        logs = server.logs()
    assert KEY not in logs
    assert "Traceback" not in logs and "ClientDisconnect" not in logs
    assert "auth='on (--api-key-file" in logs  # the start-up line says auth is on, and how


def test_the_redaction_step_scrubs_keys_values_and_tracebacks(capsys) -> None:
    redactor = Redactor()
    redactor.add(KEY)
    event = redactor(None, "error", {"event": f"failed with {KEY}", "authorization": "Bearer x",
                                     "body": b'{"prompt": "private"}', "detail": "header: Bearer abc.def"})
    assert event == {"event": "failed with [redacted]", "authorization": "[redacted]", "body": "[redacted]",
                     "detail": "header: Bearer [redacted]"}

    REDACTOR.add(KEY)
    configure_logging("info")
    log = structlog.get_logger("test")
    given = f"Bearer {KEY}".encode()  # a local of the failing frame: rich's traceback printed it
    try:
        raise RuntimeError("boom " + given.decode())
    except RuntimeError:
        log.exception("unhandled error in a route")
    out = capsys.readouterr()
    text = out.out + out.err
    assert "unhandled error in a route" in text and "Traceback" in text
    assert KEY not in text and "given =" not in text  # plain traceback: no locals
    assert len(text) < 4000, len(text)


def test_stdlib_records_are_redacted_too() -> None:
    import logging

    from atlas.server.logconfig import install_stdlib_redaction

    REDACTOR.add(KEY)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        install_stdlib_redaction()
        try:
            raise ValueError(f"auth header was Bearer {KEY}")
        except ValueError:
            logger.error("Exception in ASGI application %s", KEY, exc_info=True)
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "Exception in ASGI application" in text and "ValueError" in text and KEY not in text


def test_floods_of_one_kind_of_log_line_are_rate_limited() -> None:
    import logging

    from atlas.server.logconfig import install_stdlib_redaction

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    try:
        install_stdlib_redaction()
        for _ in range(1000):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                logger.error("socket.accept() out of system resource", exc_info=True)
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "Traceback" not in stream.getvalue()
