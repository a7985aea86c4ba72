"""Served: a non-streaming request whose model loops completes with 200 after a rollback, and the trace shows
the rollback event with the restored cursors; a streaming one cannot be rewound (its tokens reached the
client), so it ends with `stop` and the typed reason in the response and the trace."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch
from test_rollback_engine import PATTERN, LoopingBackend, config

from atlas.backends.cpu import CpuBackend
from atlas.config import derive_capacities
from atlas.engine.engine import Engine
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.registry import open_trace
from atlas.replay.reader import TraceReader
from atlas.replay.summary import summarize
from atlas.replay.verify import check_state_only, compare, redrive
from atlas.server.serve import serve_in_thread

PROMPT = "Loop test: "  # the scripted loop counts generated tokens from this prompt's end


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


def test_a_looping_request_is_served_after_a_rollback_and_traced(tiny, tmp_path) -> None:
    cfg = config()
    caps = derive_capacities(cfg, tiny.spec, activation_bytes=4)
    trace = tmp_path / "loop.sqlite"

    def looping_engine(sink) -> Engine:
        inner = CpuBackend(tiny, num_kv_blocks=caps.num_kv_blocks, block_size=caps.block_size,
                           ring_slots=caps.ring_slots)
        return Engine(LoopingBackend(inner, len(PROMPT.encode())), tokenizer=tiny.tokenizer, config=cfg,
                      capacities=caps, spec=tiny.spec, sink=sink)

    engine = looping_engine(open_trace(str(trace), model="atlas-tiny", fingerprint=tiny.fingerprint,
                                       backend="cpu-looping", config=cfg, caps=caps))
    body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True}
    with serve_in_thread(engine) as served, httpx.Client(base_url=served.url, timeout=60) as http:
        whole = http.post("/v1/completions", json=body)
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        want = {"atlas:num_rollbacks_total": 1.0, "atlas:num_rollback_declines_total": 1.0}
        for _ in range(200):  # the loop refreshes its stats just after it hands out a step's outputs
            metrics = {line.split("{")[0]: float(line.split()[-1]) for line in http.get("/metrics").text.splitlines()
                       if line.startswith("atlas:num_rollback")}
            if metrics == want:
                break
            time.sleep(0.01)

    assert whole.status_code == 200
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "length" and whole.json()["usage"]["completion_tokens"] == 60
    loop = bytes(PATTERN).decode()
    assert loop in choice["text"] and loop * 2 not in choice["text"]  # one copy kept, then re-steered
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "rollback declined: streamed" in chunks[-1]["choices"][0]["finish_detail"]
    assert metrics == want

    reader = TraceReader(trace)
    try:
        recorded = list(reader.events(reader.run().run_id))
    finally:
        reader.close()
    (rolled,) = [e.payload for e in recorded if e.kind == "rolled_back"]
    # the restore ran as an order of the next plan
    at = next(i for i, e in enumerate(recorded) if e.kind == "rolled_back")
    nxt = next(e for e in recorded[at:] if e.kind == "step_planned")
    assert nxt.payload["restored"] == [rolled["seq_id"]]
    assert rolled["keep"] == len(PROMPT) + 10 and rolled["ban_token"] == PATTERN[0]
    (declined,) = [e.payload for e in recorded if e.kind == "rollback_declined"]
    assert declined["reason"] == "streamed"
    details = [e.payload["detail"] for e in recorded if e.kind == "request_finished"]
    assert details[0] == "max_tokens 60" and "rollback declined: streamed" in details[1]
    arrived = [e.payload["stream"] for e in recorded if e.kind == "request_arrived"]
    assert arrived == [False, True]

    # the trace audits on the state machines alone, and re-driving its inputs reproduces it event for event
    assert check_state_only(trace).problem is None
    replayed = looping_engine(RecordingSink())
    assert redrive(replayed, recorded) == "ended"
    assert compare(recorded, replayed.sink.rows) is None  # type: ignore[union-attr]
    summary = {r.request_id: r for r in summarize(trace).requests}
    held = next(r for r in summary.values() if r.finish_reason == "length")
    assert held.completion_tokens == 60 and held.rollbacks == 1  # the dropped loop is not counted
