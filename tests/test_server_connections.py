"""Bounded connections (a CI-sized flood; benchmarks/server_flood.py is the full-size one): idle, slow-header
and slow-body connections are cut by their deadlines, a newcomer over the connection cap gets a 503 while the
connections already open keep working (none is evicted for it), the in-flight bound answers 503, and /health
and a completion answer within 2 s throughout."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from atlas.config import EngineConfig
from atlas.registry import build_engine
from atlas.server.lifecycle import ServerSettings
from atlas.server.metrics import sample_value
from atlas.server.security import RequestLimits
from atlas.server.serve import Served, serve_in_thread

SLOW_HEAD = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
             b"content-length: 100\r\n\r\n")


def _served(**settings: object) -> Iterator[Served]:
    engine = build_engine("atlas-tiny", "null", config=EngineConfig(max_seq_len=256))
    with serve_in_thread(engine, settings=ServerSettings(**settings)) as s:  # type: ignore[arg-type]
        yield s


def _connect(served: Served) -> socket.socket:
    s = socket.create_connection((served.server.host, served.server.port), timeout=10)
    s.settimeout(10)
    return s


def _closed_by_server(s: socket.socket, within: float) -> bytes | None:
    """What the server sent before closing, or None if it still holds the connection after `within` s."""
    s.settimeout(within)
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


def _timed(http: httpx.Client, method: str, path: str, **kw: object) -> tuple[int, float]:
    started = time.monotonic()
    r = http.request(method, path, **kw)  # type: ignore[arg-type]
    return r.status_code, time.monotonic() - started


def _metric(served: Served, name: str) -> float:
    return sample_value(served.app.state.metrics.registry, name, {"model_name": "atlas-tiny"}) or 0.0


@pytest.fixture()
def flooded() -> Iterator[Served]:
    yield from _served(max_connections=150, header_timeout=1.5, keep_alive_timeout=1.0,
                       requests=RequestLimits(body_timeout=2.0))


def test_a_small_flood_of_idle_and_slow_clients() -> None:
    for flooded in _served(max_connections=150, header_timeout=1.5, requests=RequestLimits(body_timeout=2.0)):
        with httpx.Client(base_url=flooded.url, timeout=10) as http:
            assert http.get("/health").status_code == 200  # connected before the flood: it keeps its connection
            slow = []
            for _ in range(20):
                s = _connect(flooded)
                s.sendall(SLOW_HEAD + b'{"pro')
                slow.append(s)
            idle = [_connect(flooded) for _ in range(300)]  # twice the cap: the last ones are refused
            worst = 0.0
            for _ in range(3):
                status, took = _timed(http, "GET", "/health")
                assert status == 200
                worst = max(worst, took)
                status, took = _timed(http, "POST", "/v1/completions",
                                      json={"prompt": "under flood", "max_tokens": 4, "ignore_eos": True})
                assert status == 200
                worst = max(worst, took)
        assert worst < 2.0, worst
        assert _metric(flooded, "atlas:http_connections_open") <= 150
        assert _metric(flooded, "atlas:http_connections_refused_total") >= 150
        # the slow bodies are cut at their deadline with a 408 and a close; idle ones at the header deadline (they
        # sent nothing: a plain close); the ones over the cap got a 503 at once
        for s in slow:
            answer = _closed_by_server(s, 5.0)
            assert answer is not None and answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer
        for s in idle[:100]:
            assert _closed_by_server(s, 5.0) == b""
        for s in idle[-100:]:
            answer = _closed_by_server(s, 5.0)
            assert answer is not None and answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        assert _metric(flooded, "atlas:http_header_timeouts_total") >= 1
        for s in idle + slow:
            s.close()


def test_trickled_headers_and_idle_keep_alive_are_cut(flooded: Served) -> None:
    trickle = _connect(flooded)
    started = time.monotonic()
    answer = None
    for byte in b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 200:  # a byte every 50 ms: never done
        try:
            trickle.sendall(bytes([byte]))
        except OSError:
            break
        time.sleep(0.05)
        if time.monotonic() - started > 3:
            break
    answer = _closed_by_server(trickle, 3.0)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - started < 1.5 + 3.5  # the header deadline does not reset per byte
    kept = _connect(flooded)
    kept.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    response = b""
    while b'{"status":"ok"}' not in response:
        response += kept.recv(4096)
    assert response.startswith(b"HTTP/1.1 200")
    t = time.monotonic()
    assert _closed_by_server(kept, 4.0) == b""  # keep-alive: closed once idle past its timeout
    assert time.monotonic() - t < 3.0


def test_at_the_cap_with_every_connection_busy_a_newcomer_gets_503() -> None:
    for served in _served(max_connections=4, header_timeout=5.0, requests=RequestLimits(body_timeout=5.0)):
        busy = []
        for _ in range(4):
            s = _connect(served)
            s.sendall(SLOW_HEAD + b"{")  # a request in flight
            busy.append(s)
        time.sleep(0.3)
        late = _connect(served)
        late.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = _closed_by_server(late, 3.0)
        assert answer is not None and answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        assert _metric(served, "atlas:http_connections_refused_total") >= 1
        for s in busy:
            s.close()
        time.sleep(0.3)
        with httpx.Client(base_url=served.url, timeout=5) as http:
            assert http.get("/health").status_code == 200  # room again


def test_over_the_cap_newcomers_get_503_and_the_open_connections_keep_working() -> None:
    # evicting the longest idle connection for a newcomer closed legitimate just-opened connections without a
    # response (cap 1000 under a flood: /health answered 2 of 8)
    for served in _served(max_connections=4, header_timeout=5.0):
        kept = [_connect(served) for _ in range(3)]
        for s in kept:
            assert _get_health(s).startswith(b"HTTP/1.1 200")  # kept alive, idle between requests
        fresh = _connect(served)  # opened, its request not sent yet
        time.sleep(0.2)
        for _ in range(8):
            late = _connect(served)
            late.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            answer = _closed_by_server(late, 3.0)
            assert answer is not None and answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
            late.close()
        for s in [*kept, fresh]:
            assert _get_health(s).startswith(b"HTTP/1.1 200")
        assert _metric(served, "atlas:http_connections_refused_total") == 8
        assert _metric(served, "atlas:http_connections_open") == 4
        fresh.close()
        time.sleep(0.2)
        with httpx.Client(base_url=served.url, timeout=5) as http:
            assert http.get("/health").status_code == 200  # room again
        for s in kept:
            s.close()


def test_the_in_flight_bound_answers_503_but_not_to_probes() -> None:
    for served in _served(requests=RequestLimits(max_concurrency=2, body_timeout=5.0)):
        holders = []
        for _ in range(2):
            s = _connect(served)
            s.sendall(SLOW_HEAD + b"{")
            holders.append(s)
        time.sleep(0.3)
        with httpx.Client(base_url=served.url, timeout=5) as http:
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
            assert "max_concurrency 2" in r.json()["error"]["message"]
            assert http.get("/health").status_code == 200
        for s in holders:
            s.close()


def test_a_413_closes_the_connection() -> None:
    for served in _served():
        s = _connect(served)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"transfer-encoding: chunked\r\n\r\n")
        sent = 0
        try:
            while sent < (2 << 20):
                s.sendall(b"10000\r\n" + b" " * 0x10000 + b"\r\n")
                sent += 0x10000
        except OSError:
            pass
        answer = _closed_by_server(s, 5.0)
        assert answer is not None and answer.startswith(b"HTTP/1.1 413") and b"connection: close" in answer.lower()


def test_connections_keep_serving_after_the_bounds_fired() -> None:
    for served in _served(max_connections=32, header_timeout=0.5):
        sockets = [_connect(served) for _ in range(64)]
        time.sleep(1.0)
        results: list[int] = []

        def call(served: Served = served, results: list[int] = results) -> None:
            with httpx.Client(base_url=served.url, timeout=10) as http:
                results.append(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code)

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 8
        for s in sockets:
            s.close()


def _get_health(s: socket.socket) -> bytes:
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    response = b""
    while b'{"status":"ok"}' not in response:
        chunk = s.recv(4096)
        if not chunk:
            break
        response += chunk
    return response


def test_an_idle_kept_alive_connection_outlives_the_header_timeout() -> None:
    # a kept-alive connection is the keep-alive timer's until its next request's first byte: the header deadline
    # used to run from the last response, so it closed idle connections at header_timeout (10 s), under the
    # keep-alive timeout, and a client's next request on one met a reset
    for served in _served(header_timeout=0.3, keep_alive_timeout=5.0):
        s = _connect(served)
        assert _get_health(s).startswith(b"HTTP/1.1 200")
        time.sleep(0.9)  # three header timeouts, well inside the keep-alive timeout
        assert _get_health(s).startswith(b"HTTP/1.1 200")
        assert _metric(served, "atlas:http_header_timeouts_total") == 0
        s.close()


def test_the_server_keeps_an_idle_connection_longer_than_a_client_pool_does() -> None:
    # the server closing first races the client's next request on that connection (httpx.ReadError under load:
    # tests/test_server_load.py); httpx's pool, the OpenAI SDK's, expires an idle connection after keepalive_expiry
    pool_expiry = httpx.Limits(max_connections=1).keepalive_expiry
    assert pool_expiry is not None
    assert ServerSettings().keep_alive_timeout > 2 * pool_expiry
