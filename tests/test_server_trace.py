"""Every served request is in the trace, and the trace of a served run replays event for event."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from atlas.config import EngineConfig
from atlas.registry import build_engine
from atlas.replay.reader import TraceReader
from atlas.replay.verify import verify
from atlas.server.serve import serve_in_thread


def test_a_served_run_is_traced_and_replays(tmp_path) -> None:
    trace = tmp_path / "served.sqlite"
    engine = build_engine("atlas-tiny", backend="cpu", trace=str(trace),
                               config=EngineConfig(max_seq_len=256, max_batch_size=4))
    served_ids: list[str] = []
    with serve_in_thread(engine, enable_fault_injection=True) as served, \
            httpx.Client(base_url=served.url, timeout=60) as http:

        def whole(i: int) -> httpx.Response:
            headers = {"x-atlas-inject-fault": "step_error"} if i == 0 else {}
            return http.post("/v1/completions", headers=headers, json={
                "prompt": f"request {i}", "max_tokens": 6 + i, "temperature": 0.8, "seed": i, "ignore_eos": True})

        def streamed(i: int) -> str:
            body = {"messages": [{"role": "user", "content": f"chat {i}"}], "max_tokens": 40, "stream": True,
                    "ignore_eos": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                if i == 0:  # walks away after the first chunk: a cancellation in the trace
                    next(lines)
                else:
                    list(lines)
                return r.headers["x-request-id"]

        with ThreadPoolExecutor(6) as pool:
            wholes = list(pool.map(whole, range(4)))
            served_ids += list(pool.map(streamed, range(2)))
        served_ids += [r.headers["x-request-id"] for r in wholes if "x-request-id" in r.headers]
        assert [r.status_code for r in wholes] == [500, 200, 200, 200]
        refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10_000})
        assert refused.status_code == 400  # refused at admission: never reaches the trace

    reader = TraceReader(trace)
    try:
        run = reader.run()
        recorded = list(reader.events(run.run_id))
    finally:
        reader.close()
    arrived = [e.payload for e in recorded if e.kind == "request_arrived"]
    assert len(arrived) == 6
    assert len(served_ids) == 5 and set(served_ids) <= {p["request_id"] for p in arrived}
    kinds = {e.kind for e in recorded}
    assert {"request_cancelled", "fault_injected", "request_finished"} <= kinds

    report = verify(trace)
    assert report.identical, report.divergence.describe()
    assert report.events_replayed == len(recorded)
