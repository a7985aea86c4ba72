"""The request fields a vLLM / OpenAI client sends, on the CPU backend: n > 1 (choices, seeds, streaming, usage),
frequency/presence penalties and logit_bias honoured, the fields that cannot be honoured refused with a 400 naming
them, `user` accepted and ignored as vLLM does, and a run using them replaying identically."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from atlas.cli import run as run_cli
from atlas.config import EngineConfig
from atlas.registry import build_engine
from atlas.replay.reader import TraceReader
from atlas.replay.verify import verify
from atlas.server.serve import Served, serve_in_thread

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
MAX_SEQ_LEN = 256


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    trace = tmp_path_factory.mktemp("sampling_fields") / "t.db"
    engine = build_engine("atlas-tiny", "cpu", trace=str(trace), config=EngineConfig(max_seq_len=MAX_SEQ_LEN))
    with serve_in_thread(engine) as s:
        yield s


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


def complete(http: httpx.Client, **body: object) -> dict:
    r = http.post(COMPLETIONS, json={"prompt": "abc", "max_tokens": 8, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_n_choices_sampled_with_a_seed_differ_and_greedy_ones_agree(http: httpx.Client) -> None:
    sampled = complete(http, n=2, temperature=1.0, seed=11)
    texts = [c["text"] for c in sampled["choices"]]
    assert [c["index"] for c in sampled["choices"]] == [0, 1] and texts[0] != texts[1]
    assert complete(http, n=2, temperature=1.0, seed=11)["choices"] == sampled["choices"]  # seeded: deterministic
    assert complete(http, temperature=1.0, seed=11)["choices"][0]["text"] == texts[0]  # choice 0 is the n=1 answer
    greedy = complete(http, n=3, temperature=0.0)
    assert len({c["text"] for c in greedy["choices"]}) == 1
    usage = sampled["usage"]  # the prompt once, every choice's completion tokens
    assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == 16 and usage["total_tokens"] == 19
    two = complete(http, prompt=["abc", "de"], n=2, temperature=1.0, seed=5)
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3] and two["usage"]["prompt_tokens"] == 5
    assert two["choices"][2]["text"] == complete(http, prompt="de", temperature=1.0, seed=5)["choices"][0]["text"]


def _events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    return [json.loads(x) for x in lines[:-1]]


def test_n_choices_streamed(http: httpx.Client) -> None:
    body = {"prompt": "abc", "max_tokens": 8, "ignore_eos": True, "n": 2, "temperature": 1.0, "seed": 11, "stream": True,
            "stream_options": {"include_usage": True}}
    events = _events(http, COMPLETIONS, body)
    texts = ["", ""]
    for e in events[:-1]:
        (choice,) = e["choices"]
        texts[choice["index"]] += choice["text"]
    whole = complete(http, n=2, temperature=1.0, seed=11)
    assert texts == [c["text"] for c in whole["choices"]]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    chat = _events(http, CHAT, {"messages": USER, "max_tokens": 4, "n": 2, "stream": True,
                                "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert {e["choices"][0]["index"] for e in chat} == {0, 1} and all("usage" in e for e in chat)
    assert sum(e["choices"][0]["delta"].get("role") == "assistant" for e in chat) == 2


def test_a_client_leaving_an_n_stream_cancels_every_choice() -> None:
    config = EngineConfig(max_seq_len=32768, max_batch_size=8)
    with serve_in_thread(build_engine("atlas-tiny", "null", config=config)) as s, \
            httpx.Client(base_url=s.url, timeout=60) as http:
        body = {"prompt": "abc", "max_tokens": 32000, "ignore_eos": True, "n": 3, "stream": True}
        seen: set[int] = set()
        with http.stream("POST", COMPLETIONS, json=body) as r:
            for line in r.iter_lines():  # leave once every choice has streamed something
                if line.startswith("data: {"):
                    seen.add(json.loads(line[6:])["choices"][0]["index"])
                    if seen == {0, 1, 2}:
                        break
        assert seen == {0, 1, 2}
        for _ in range(600):  # cancellations land within a step or two (the box may be busy)
            stats = s.engine_loop.latest_stats
            if stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0:
                break
            time.sleep(0.05)
        assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0
        cancelled = [line for line in http.get("/metrics").text.splitlines()
                     if line.startswith("atlas:request_success_total{") and 'finished_reason="cancelled"' in line]
        assert [float(line.rsplit(" ", 1)[1]) for line in cancelled] == [3.0], cancelled


def test_penalties_and_logit_bias_are_honoured(http: httpx.Client) -> None:
    def text(**kw: object) -> str:
        return complete(http, temperature=0.0, max_tokens=12, **kw)["choices"][0]["text"]

    assert text(logit_bias={"120": 100}) == "x" * 12  # ord("x") == 120 on the byte tokenizer
    assert text(logit_bias={}) == text()
    freq = text(logit_bias={"120": 8.0}, frequency_penalty=2.0)
    assert freq.startswith("x") and freq != "x" * 12
    pres = text(logit_bias={"120": 3.0}, presence_penalty=2.0)
    assert text(logit_bias={"120": 3.0}) != pres


REFUSED = [  # (path, body, the field the 400 names, words in its message)
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format", "constrained decoding"),
    (COMPLETIONS, {"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool_choice 'none'"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice",
     "only 'none'"),
    (CHAT, {"tool_choice": "required"}, "tool_choice", "only 'none'"),
    (COMPLETIONS, {"tools": []}, "tools", "not supported"),
    (COMPLETIONS, {"best_of": 3}, "best_of", "equal to n (1)"),
    (COMPLETIONS, {"best_of": 2, "n": 3}, "best_of", "equal to n (3)"),
    (COMPLETIONS, {"seed": -1}, "seed", "18446744073709551615"),
    (COMPLETIONS, {"seed": 2**64}, "seed", "18446744073709551615"),
    (COMPLETIONS, {"min_tokens": 9, "max_tokens": 8}, None, "min_tokens 9 exceeds max_tokens 8"),
    (COMPLETIONS, {"min_tokens": 2**31 - 1, "max_tokens": None}, "min_tokens", "max_model_len 256 - prompt 3"),
    (COMPLETIONS, {"min_tokens": 254, "max_tokens": None}, "min_tokens", "253 tokens"),
    (COMPLETIONS, {"logit_bias": {"7": 101}}, "logit_bias.7", "100"),
    (COMPLETIONS, {"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    (COMPLETIONS, {"logit_bias": {"100000": 1}}, "logit_bias", "outside the vocabulary"),
    (COMPLETIONS, {"frequency_penalty": 2.5}, "frequency_penalty", "2"),
    (COMPLETIONS, {"presence_penalty": -3}, "presence_penalty", "-2"),
    (COMPLETIONS, {"n": 129}, "n", "128"),
    (COMPLETIONS, {"prompt": ["a", "b"], "n": 65}, "n", "2 x 65"),
    (COMPLETIONS, {"stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    (COMPLETIONS, {"stream": True, "stream_options": {"foo": True}}, "stream_options.foo", "unknown field"),
    (CHAT, {"parallel_tool_calls": True}, "parallel_tool_calls", "not supported"),
]


@pytest.mark.parametrize(("path", "extra", "param", "words"), REFUSED)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(http: httpx.Client, path: str, extra: dict,
                                                         param: str | None, words: str) -> None:
    base = {"messages": USER} if path == CHAT else {"prompt": "abc"}
    r = http.post(path, json={**base, "max_tokens": 8, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    if param:
        assert error["message"].startswith(f"{param}: ")


ACCEPTED = [
    (CHAT, {"user": "someone"}),  # ignored, as vLLM ignores it
    (COMPLETIONS, {"user": "someone"}),
    (CHAT, {"response_format": {"type": "text"}}),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}),
    (CHAT, {"tool_choice": "none"}),
    (COMPLETIONS, {"best_of": 1}),
    (COMPLETIONS, {"best_of": 2, "n": 2}),
    (COMPLETIONS, {"logit_bias": {}}),
    (COMPLETIONS, {"seed": 2**64 - 1, "temperature": 1.0}),
    (COMPLETIONS, {"temperature": 1e-320, "seed": 3}),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": None}}),
]


@pytest.mark.parametrize(("path", "extra"), ACCEPTED)
def test_accepted_fields(http: httpx.Client, path: str, extra: dict) -> None:
    base = {"messages": USER} if path == CHAT else {"prompt": "abc"}
    r = http.post(path, json={**base, "max_tokens": 4, **extra})
    assert r.status_code == 200, r.text


def test_a_tiny_temperature_is_greedy(http: httpx.Client) -> None:
    greedy = complete(http, temperature=0.0)["choices"][0]["text"]
    assert all(complete(http, temperature=t, seed=s)["choices"][0]["text"] == greedy
               for t, s in ((1e-320, 1), (1e-30, 2), (9e-6, 3)))


def test_a_run_with_the_new_fields_replays_identically(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "fields.db"
    engine = build_engine("atlas-tiny", "cpu", trace=str(trace), config=EngineConfig(max_seq_len=MAX_SEQ_LEN))
    with serve_in_thread(engine) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        complete(http, n=2, temperature=0.9, frequency_penalty=1.0, presence_penalty=-0.5, logit_bias={"120": 2.0})
        complete(http, temperature=0.0, repetition_penalty=1.5, logit_bias={"120": 4.0}, frequency_penalty=0.7)
        _events(http, CHAT, {"messages": USER, "max_tokens": 6, "n": 2, "stream": True, "presence_penalty": 1.0,
                             "temperature": 0.8})
    reader = TraceReader(trace)
    params = [e.payload["params"] for e in reader.events(reader.run().run_id) if e.kind == "request_arrived"]
    assert len(params) == 5 and {p.get("frequency_penalty") for p in params} >= {1.0, 0.7}
    assert len({p["seed"] for p in params[:2]}) == 2  # the two choices: two seeds, both recorded
    report = verify(trace)
    assert report.identical, report.divergence and report.divergence.describe()
    assert run_cli(["replay", "verify", str(trace), "--threads", "1"]) == 0, capsys.readouterr()
