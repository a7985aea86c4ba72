"""Codec 1 (atlas.replay.codec): step events as int32 BLOBs. Every step event round-trips to the same event and
the same JSON payload; a trace mixing codec-1 and JSON rows reads as one; malformed bytes are refused naming the
event; a value past int32 stays JSON; a SQLite writer stores step events as bytes and everything else as text."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atlas.errors import UnknownEvent
from atlas.replay import codec
from atlas.replay.reader import TraceReader
from atlas.replay.store import TraceWriter
from atlas.sampling.params import SamplingParams
from atlas.state.events import RequestArrived, RequestFinished, StepExecuted, StepPlanned

ints = st.lists(st.integers(-1, 2**31 - 1), max_size=70).map(tuple)
rows = st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5).map(tuple), max_size=6).map(tuple)


@st.composite
def planned(draw: st.DrawFn) -> StepPlanned:
    seqs = draw(ints)
    fed = draw(st.lists(st.integers(0, 4096), min_size=len(seqs), max_size=len(seqs)))
    drafts = draw(st.lists(st.lists(st.integers(0, 255), max_size=4).map(tuple), min_size=len(seqs),
                           max_size=len(seqs))) if draw(st.booleans()) else ()
    return StepPlanned(draw(st.integers(0, 2**31 - 1)), draw(ints), seqs, fed, draw(rows), draw(ints), draw(ints),
                       drafts, draw(ints))


@settings(max_examples=120, deadline=None)
@given(e=st.one_of(planned(), st.builds(StepExecuted, st.integers(0, 2**31 - 1), ints, ints, ints)))
def test_a_step_event_round_trips_to_the_same_event_and_payload(e: StepPlanned | StepExecuted) -> None:
    raw = codec.encode(e)
    assert isinstance(raw, bytes) and raw[0] == codec.CODEC
    back = codec.load_event(e.kind, e.version, raw)
    assert back == e and type(back) is type(e)
    tuples = (back.tokens, back.accepted) if isinstance(back, StepExecuted) else (back.seqs, back.fed, back.alloc)
    assert all(type(v) is tuple for v in tuples)  # as the converters make them (events hash and compare so)
    assert codec.decode(e.kind, e.version, raw) == json.loads(e.payload_json())
    assert back.payload_json() == e.payload_json()


def test_what_codec_1_does_not_cover_stays_json() -> None:
    assert codec.encode(RequestFinished(3, "length", "max_tokens 3")) is None
    assert codec.encode(StepExecuted(1, (2**31,))) is None  # past int32


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, seed=-9, stop=("é",)).to_json(), {},
                                    {"top_k": 2, "seed": 2**63 - 1}, {"seed": 0}])
def test_an_arrival_round_trips_to_the_same_event_and_payload(params: dict) -> None:
    e = RequestArrived(request_id="r-é", seq_id=7, prompt=(0, -1, 2**31 - 1, 5), params=params, max_new=9,
                       stream=True)
    raw = codec.encode(e)
    assert type(raw) is bytes
    assert codec.load_event(e.kind, e.version, raw) == e
    payload = codec.decode(e.kind, e.version, raw)
    assert json.dumps(payload) == json.dumps(json.loads(e.payload_json()))  # the same dict, key order included
    for cut in (raw[:-1], raw + b"x", raw[:codec.ARRIVED.size - 1]):
        with pytest.raises(UnknownEvent, match="request_arrived v2"):
            codec.load_event(e.kind, e.version, cut)


def test_an_arrival_past_the_layout_stays_json() -> None:
    def arrival(prompt: tuple[int, ...], params: dict) -> RequestArrived:
        return RequestArrived(request_id="r", seq_id=0, prompt=prompt, params=params, max_new=2)

    assert codec.encode(arrival((2**31,), {})) is None  # a token past int32
    assert codec.encode(arrival((1,), {"seed": 2**63})) is None  # a seed past int64
    assert codec.encode(arrival((1,), {"seed": 1.5})) is None  # a seed that is not an int
    assert codec.encode(arrival((1,), {"seed": True})) is None


@pytest.mark.parametrize("raw", [b"", b"\x02" + bytes(8), b"\x01" + bytes(3), b"\x01" + (5).to_bytes(4, "little"),
                                 b"\x01" + bytes(4) + (9).to_bytes(4, "little") + bytes(4)])
def test_malformed_bytes_are_refused_naming_the_event(raw: bytes) -> None:
    with pytest.raises(UnknownEvent, match="step_executed v2"):
        codec.load_event("step_executed", 2, raw)


def test_bytes_of_a_version_without_a_layout_are_refused() -> None:
    raw = codec.encode(StepExecuted(1, (5,)))
    assert raw is not None
    with pytest.raises(UnknownEvent, match="step_executed v1"):
        codec.decode("step_executed", 1, raw)


def test_a_sqlite_trace_stores_steps_as_codec_1_and_reads_mixed_rows(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    run = {"engine_version": "t", "git_revision": None, "model": "m", "model_fingerprint": "f", "backend": "null",
           "seed": None, "config": {}, "capacities": {}}
    writer = TraceWriter(path, run=run)
    events = [StepPlanned(0, (0,), (0,), (3,), ((0, 7),), (), ()), StepExecuted(0, (42,)),
              RequestFinished(0, "length", "max_tokens 1")]
    for i, e in enumerate(events):
        writer.append(i, 0, e, f"{i:016x}")
    writer.append_row(3, 1, "step_executed", 1, json.dumps({"step": 1, "tokens": [-1]}), "0" * 16)  # v1, JSON
    writer.close()
    con = sqlite3.connect(path)
    stored = [type(p) for (p,) in con.execute("select payload from events order by idx")]
    con.close()
    assert stored == [bytes, bytes, str, str]
    reader = TraceReader(path)
    try:
        got = [e for _, _, _, e, _ in reader.event_rows(1)]
        payloads = [r.payload for r in reader.events(1)]
    finally:
        reader.close()
    assert got[:3] == events and got[3] == StepExecuted(1, (-1,), (), ())  # the v1 row upcast
    assert payloads[:3] == [json.loads(e.payload_json()) for e in events]
