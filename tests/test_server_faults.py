"""Honest endings under faults: step errors, cancellation, a full queue, and a fatal fault."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fixtures.serving import ServeProcess

from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.registry import build_engine
from atlas.replay.reader import TraceReader
from atlas.server.metrics import sample_value
from atlas.server.serve import EXIT_ENGINE_DEAD, Served, serve_in_thread

FAULT = {"x-atlas-inject-fault": "step_error"}


def _engine(**config: int) -> Engine:
    return build_engine("atlas-tiny", backend="null", config=EngineConfig(**config))


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The stream's data payloads, decoded; the final `[DONE]` stays a string."""
    events: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _finished_count(served: Served, reason: str) -> float:
    return sample_value(served.app.state.metrics.registry, "atlas:request_success_total",
                        {"model_name": "atlas-tiny", "finished_reason": reason}) or 0.0


def _wait_idle(served: Served, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = served.engine_loop.latest_stats
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {served.engine_loop.latest_stats}")


def test_step_errors_end_as_errors_never_as_stop_or_length() -> None:
    n = 4
    with serve_in_thread(_engine(), enable_fault_injection=True) as served, \
            httpx.Client(base_url=served.url, timeout=30) as http:
        body = {"prompt": "hello", "max_tokens": 50, "ignore_eos": True}

        def whole(_: int) -> httpx.Response:
            return http.post("/v1/completions", json=body, headers=FAULT)

        def streamed(_: int) -> list[dict | str]:
            with http.stream("POST", "/v1/chat/completions", headers=FAULT, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "ignore_eos": True,
                "stream": True,
            }) as r:
                assert r.status_code == 200
                return sse_events(r)

        with ThreadPoolExecutor(2 * n) as pool:
            wholes = list(pool.map(whole, range(n)))
            streams = list(pool.map(streamed, range(n)))

        for r in wholes:
            assert r.status_code == 500
            error = r.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "engine_error"
            assert "injected step_error" in error["message"] and "Traceback" not in error["message"]
            assert "(cmpl-" in error["message"]  # the request id, to find it in the trace
        for events in streams:
            assert events[-1] == "[DONE]"
            errors = [e for e in events[:-1] if "error" in e]
            assert len(errors) == 1 and errors[0] == events[-2]
            finishes = [c["finish_reason"] for e in events[:-1] if "choices" in e for c in e["choices"]]
            assert all(f is None for f in finishes)
        assert _finished_count(served, "error") == 2 * n
        assert _finished_count(served, "stop") == _finished_count(served, "length") == 0
        # an unfaulted request afterwards is served normally
        ok = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        _wait_idle(served)


def test_client_disconnect_cancels_and_frees_blocks() -> None:
    # long enough budgets that neither request can finish on its own while the test watches
    with serve_in_thread(_engine(max_seq_len=1 << 20, max_batch_size=4)) as served, \
            httpx.Client(base_url=served.url, timeout=30) as http:
        # a stream abandoned after its first chunk, and a whole request whose client times out
        with http.stream("POST", "/v1/completions", json={
            "prompt": "x" * 40, "max_tokens": 1_000_000, "ignore_eos": True, "stream": True,
        }) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"prompt": "y" * 40, "max_tokens": 1_000_000, "ignore_eos": True},
                      timeout=0.2)
        deadline = time.monotonic() + 10
        while _finished_count(served, "cancelled") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _finished_count(served, "cancelled") == 2
        assert _finished_count(served, "length") == 0  # neither ran to its budget
        _wait_idle(served)


def test_a_full_waiting_queue_answers_503_quickly() -> None:
    engine = _engine(max_seq_len=1 << 20, max_batch_size=1, max_waiting=1, prefill_chunk_tokens=64)
    with serve_in_thread(engine) as served, httpx.Client(base_url=served.url, timeout=30) as http:
        long = {"prompt": "z", "max_tokens": 1_000_000, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=long) as running:
            lines = running.iter_lines()  # kept: a collected iterator would close the connection
            next(lines)  # it holds the one batch slot
            with http.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # admitted to the waiting queue
                start = time.monotonic()
                refused = http.post("/v1/completions", json={"prompt": "w", "max_tokens": 2})
                assert time.monotonic() - start < 5.0  # not a speed target: a refusal, not a 30 s timeout
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "queue_full"
                assert "max_waiting 1" in refused.json()["error"]["message"]
        _wait_idle(served)


def test_fatal_fault_turns_every_route_503_and_ends_open_streams_with_an_error() -> None:
    with serve_in_thread(_engine(max_seq_len=1 << 20), enable_fault_injection=True) as served, \
            httpx.Client(base_url=served.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        with http.stream("POST", "/v1/completions", json={
            "prompt": "x", "max_tokens": 1_000_000, "ignore_eos": True, "stream": True,
        }) as r:
            lines = r.iter_lines()
            next(lines)
            assert http.post("/debug/inject_fault", json={"kind": "fatal"}).status_code == 200
            events = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in lines if x.startswith("data: ")]
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
        assert all(c["finish_reason"] is None for e in events[:-2] for c in e["choices"])
        for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"),
                             ("POST", "/v1/completions"), ("POST", "/tokenize")):
            r = http.request(method, path, json={"prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", path


def test_serve_process_exits_non_zero_after_a_fatal_fault(tmp_path) -> None:
    trace = tmp_path / "trace.sqlite"
    with ServeProcess(tmp_path, "--backend", "null", "--trace", str(trace), "--enable-fault-injection") as served:
        url = served.wait_ready(timeout=60).url
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert ok.status_code == 200
        assert httpx.post(f"{url}/debug/inject_fault", json={"kind": "fatal"}, timeout=10).status_code == 200
        try:  # the server answers 503 in its grace period, or is already gone
            assert httpx.get(f"{url}/health", timeout=2).status_code == 503
        except httpx.TransportError:
            pass
        code = served.wait(timeout=20)
        assert code == EXIT_ENGINE_DEAD, served.logs()
        reader = TraceReader(trace)  # flushed before exit: the served request and the fatal fault are in it
        try:
            recorded = list(reader.events(reader.run().run_id))
        finally:
            reader.close()
        kinds = [e.kind for e in recorded]
        assert kinds.count("request_arrived") == 1 and kinds.count("request_finished") == 1
        assert any(e.kind == "engine_faulted" and e.payload.get("fatal") for e in recorded)


def test_stopping_the_loop_ends_live_requests_with_503_not_a_hang() -> None:
    with serve_in_thread(_engine(max_seq_len=1 << 20)) as served, \
            httpx.Client(base_url=served.url, timeout=30) as http:
        endless = {"prompt": "x", "max_tokens": 1_000_000, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool, http.stream("POST", "/v1/completions",
                                                        json={**endless, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            whole = pool.submit(http.post, "/v1/completions", json=endless)
            deadline = time.monotonic() + 10
            while served.engine_loop.latest_stats.num_running < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            served.engine_loop.stop()
            events = [x[6:] for x in lines if x.startswith("data: ")]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
            assert whole.result().status_code == 503
            assert whole.result().json()["error"]["code"] == "shutting_down"
        late = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"


def test_the_official_client_sees_a_failed_stream_as_an_error() -> None:
    with serve_in_thread(_engine(), enable_fault_injection=True) as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="atlas-tiny", prompt="hi", max_tokens=20, stream=True,
                                           extra_headers=FAULT)
        with pytest.raises(openai.APIError, match="injected step_error"):
            for _ in stream:
                pass
        with pytest.raises(openai.InternalServerError, match="injected step_error"):
            client.completions.create(model="atlas-tiny", prompt="hi", max_tokens=20, extra_headers=FAULT)


def test_fault_injection_is_off_unless_enabled() -> None:
    with serve_in_thread(_engine()) as served, httpx.Client(base_url=served.url, timeout=30) as http:
        r = http.post("/v1/completions", headers={"x-atlas-inject-fault": "fatal"},
                      json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert http.post("/debug/inject_fault", json={"kind": "fatal"}).status_code == 404
        assert http.get("/health").status_code == 200 and served.engine_loop.dead is None


def test_an_abandoned_request_logs_one_line_not_a_traceback(tmp_path) -> None:
    # a whole request whose client left used to log an 11-line ERROR ("_GatheringFuture exception was never
    # retrieved" and its CancelledError traceback)
    with ServeProcess(tmp_path, "--backend", "null", "--max-seq-len", str(1 << 20), "--max-batch-size", "4") as server:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json={"prompt": "y" * 40, "max_tokens": 1_000_000, "ignore_eos": True},
                          timeout=0.3)
            with http.stream("POST", "/v1/completions", json={
                "prompt": "x" * 40, "max_tokens": 1_000_000, "ignore_eos": True, "stream": True,
            }) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break
            cancelled = 'atlas:request_success_total{finished_reason="cancelled",model_name="atlas-tiny"} 2.0'
            deadline = time.monotonic() + 20
            while cancelled not in http.get("/metrics").text and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cancelled in http.get("/metrics").text
        server.signal(signal.SIGTERM)
        assert server.wait() == 0
        logs = server.logs()
    assert logs.count("client disconnected: request cancelled") == 2, logs
    assert "Traceback" not in logs and "never retrieved" not in logs and "[error" not in logs, logs
