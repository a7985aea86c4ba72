"""Honest shutdown: on SIGTERM/SIGINT nothing new is admitted (503 shutting_down), requests in flight get
--shutdown-grace to finish, the rest end with an SSE error event + [DONE] or a JSON 503, every outcome is in
the trace, which ends with its run-end marker, and the process exits 0."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fixtures.serving import ServeProcess

from atlas.replay.reader import TraceReader
from atlas.replay.verify import verify

LONG = 1500  # tokens: far more than a 3 s grace lets atlas-tiny produce on a CPU


def _sse(lines: list[str]) -> list[dict | str]:
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _live(http: httpx.Client) -> int:
    text = http.get("/metrics").text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith(("atlas:num_requests_running{", "atlas:num_requests_waiting{")))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_then_ends_the_rest_honestly(tmp_path: Path, sig: int) -> None:
    trace = tmp_path / "served.db"
    with ServeProcess(tmp_path, "--trace", str(trace), "--shutdown-grace", "3", "--max-seq-len", "2048",
                      "--threads", "1") as server, httpx.Client(base_url=server.url, timeout=120) as http:
        server.wait_ready()
        first_chunk = []

        def long_stream() -> list[dict | str]:
            body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": LONG, "ignore_eos": True,
                    "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data: ") and not first_chunk:
                        first_chunk.append(time.monotonic())
                return _sse(lines)

        def whole(max_tokens: int) -> httpx.Response:
            return http.post("/v1/completions", json={"prompt": "hello", "max_tokens": max_tokens,
                                                      "ignore_eos": True})

        with ThreadPoolExecutor(4) as pool:
            streamed = pool.submit(long_stream)
            long_whole = pool.submit(whole, LONG)
            deadline = time.monotonic() + 60
            while not first_chunk and time.monotonic() < deadline:
                time.sleep(0.02)
            assert first_chunk, "the stream never started"
            short_whole = pool.submit(whole, 8)  # in flight at the signal, done well within the grace
            while _live(http) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            signaled = time.monotonic()
            server.signal(sig)
            time.sleep(0.3)
            late = http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            events = streamed.result(timeout=60)
            cut = long_whole.result(timeout=60)
            short = short_whole.result(timeout=60)
        code = server.wait(timeout=60)
        took = time.monotonic() - signaled
        logs = server.logs()

    assert code == 0, logs
    assert took < 3 + 10, took
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    assert cut.status_code == 503 and cut.json()["error"]["code"] == "shutting_down"
    assert "grace" in cut.json()["error"]["message"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", events[-3:]
    texts = [e for e in events[:-2] if isinstance(e, dict) and "choices" in e]
    assert texts and all(c["finish_reason"] is None for e in texts for c in e["choices"])  # cut, never "length"
    assert "ended_by_shutdown=2" in logs and "Traceback" not in logs

    reader = TraceReader(trace)
    try:
        run = reader.run()
        recorded = list(reader.events(run.run_id))
        end = reader.end(run.run_id)
    finally:
        reader.close()
    assert end.status == "ended" and end.events == len(recorded)
    arrived = {e.payload["seq_id"]: e.payload for e in recorded if e.kind == "request_arrived"}
    ended = {e.payload["seq_id"]: e.kind for e in recorded if e.kind in ("request_finished", "request_cancelled")}
    assert len(arrived) == 3 and set(ended) == set(arrived)  # every outcome recorded
    assert sorted(ended.values()) == ["request_cancelled", "request_cancelled", "request_finished"]
    report = verify(trace)
    assert report.identical, report.divergence.describe()
