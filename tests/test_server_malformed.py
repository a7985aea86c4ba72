"""A corpus of malformed requests: each is a 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from atlas.config import EngineConfig
from atlas.registry import build_engine
from atlas.server.app import DEFAULT_MAX_BODY_BYTES
from atlas.server.serve import Served, serve_in_thread

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def _j(obj: object) -> bytes:
    return json.dumps(obj).encode()


# (path, raw body, expected status, the param the error should name, or None when it names none)
CORPUS: list[tuple[str, bytes, int, str | None]] = [
    # not JSON, or not an object
    (COMPLETIONS, b"", 400, None),
    (COMPLETIONS, b"{", 400, None),
    (COMPLETIONS, b'{"prompt": }', 400, None),
    (COMPLETIONS, b"null", 400, None),
    (COMPLETIONS, b"[]", 400, None),
    (COMPLETIONS, b'"prompt"', 400, None),
    (COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, None),
    (COMPLETIONS, b'{"prompt": "x", "top_p": Infinity}', 400, None),
    (COMPLETIONS, b"[" * 200_000 + b"]" * 200_000, 400, None),
    (COMPLETIONS, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None),
    # invalid UTF-8 and invalid Unicode
    (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),
    (COMPLETIONS, b'{"prompt": "\\ud800"}', 400, "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages"),
    # missing and wrong types
    (COMPLETIONS, _j({}), 400, "prompt"),
    (COMPLETIONS, _j({"prompt": 5}), 400, "prompt"),
    (COMPLETIONS, _j({"prompt": {"text": "x"}}), 400, "prompt"),
    (COMPLETIONS, _j({"prompt": [1, "a"]}), 400, "prompt.1"),
    (COMPLETIONS, _j({"prompt": "x", "max_tokens": "5"}), 400, "max_tokens"),
    (COMPLETIONS, _j({"prompt": "x", "max_tokens": 1.5}), 400, "max_tokens"),
    (COMPLETIONS, _j({"prompt": "x", "temperature": "hot"}), 400, "temperature"),
    (COMPLETIONS, _j({"prompt": "x", "temperature": True}), 400, "temperature"),
    (COMPLETIONS, _j({"prompt": "x", "stream": "yes"}), 400, "stream"),
    (COMPLETIONS, _j({"prompt": "x", "stop": 5}), 400, "stop"),
    (COMPLETIONS, _j({"prompt": "x", "stop": [1]}), 400, "stop.0"),
    (COMPLETIONS, _j({"prompt": "x", "seed": "1"}), 400, "seed"),
    (COMPLETIONS, _j({"prompt": "x", "logprobs": True}), 400, "logprobs"),
    (COMPLETIONS, _j({"prompt": "x", "model": 7}), 400, "model"),
    (CHAT, _j({"messages": "hi"}), 400, "messages"),
    (CHAT, _j({"messages": [{"role": "wizard", "content": "x"}]}), 400, "messages.0.role"),
    (CHAT, _j({"messages": [{"content": "x"}]}), 400, "messages.0.role"),
    (CHAT, _j({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}), 400,
     "messages.0.content.0.type"),
    # negative, zero and huge values
    (COMPLETIONS, _j({"prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
    (COMPLETIONS, _j({"prompt": "x", "max_tokens": 0}), 400, "max_tokens"),
    (COMPLETIONS, _j({"prompt": "x", "max_tokens": 10**30}), 400, "max_tokens"),
    (COMPLETIONS, _j({"prompt": "x", "max_tokens": 100_000}), 400, "max_tokens"),  # over max_seq_len
    (COMPLETIONS, _j({"prompt": "x", "temperature": -1}), 400, "temperature"),
    (COMPLETIONS, _j({"prompt": "x", "temperature": 1e308 * 10}), 400, None),  # json.dumps writes Infinity
    (COMPLETIONS, b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    (COMPLETIONS, _j({"prompt": "x", "top_p": 0}), 400, "top_p"),
    (COMPLETIONS, _j({"prompt": "x", "top_p": 1.5}), 400, "top_p"),
    (COMPLETIONS, _j({"prompt": "x", "top_k": -2}), 400, "top_k"),
    (COMPLETIONS, _j({"prompt": "x", "seed": 2**70}), 400, "seed"),
    (COMPLETIONS, _j({"prompt": "x", "n": 0}), 400, "n"),
    (COMPLETIONS, _j({"prompt": "x", "seed": -1}), 400, "seed"),
    (COMPLETIONS, _j({"prompt": "x", "logprobs": 21}), 400, "logprobs"),
    (COMPLETIONS, _j({"prompt": "x", "stop": ["s"] * 17}), 400, None),
    (COMPLETIONS, _j({"prompt": "x", "stop": [""]}), 400, "stop.0"),
    (COMPLETIONS, _j({"prompt": [-1]}), 400, "prompt.0"),
    (COMPLETIONS, _j({"prompt": [10**6]}), 400, "prompt"),  # outside the vocabulary
    (COMPLETIONS, _j({"prompt": ["a"] * 129}), 400, None),  # more prompts than one request may carry
    (CHAT, _j({"messages": USER, "top_logprobs": 2}), 400, None),
    (CHAT, _j({"messages": USER, "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs"),
    (CHAT, _j({"messages": USER, "max_completion_tokens": -5}), 400, "max_completion_tokens"),
    (CHAT, _j({"messages": USER, "presence_penalty": 2.5}), 400, "presence_penalty"),
    (CHAT, _j({"messages": USER, "stream_options": {"include_usage": True}}), 400, "stream_options"),
    # empty prompts
    (COMPLETIONS, _j({"prompt": ""}), 400, "prompt"),
    (COMPLETIONS, _j({"prompt": []}), 400, "prompt"),
    (CHAT, _j({"messages": []}), 400, "messages"),
    # unknown model
    (COMPLETIONS, _j({"prompt": "x", "model": "gpt-4"}), 404, "model"),
    (CHAT, _j({"messages": USER, "model": "nope"}), 404, "model"),
    # tokenize / detokenize
    ("/tokenize", _j({}), 400, None),
    ("/tokenize", _j({"prompt": "x", "messages": USER}), 400, None),
    ("/detokenize", _j({"tokens": [-1]}), 400, "tokens.0"),
    ("/detokenize", _j({"tokens": "abc"}), 400, "tokens"),
    ("/detokenize", _j({"tokens": [10**6]}), 400, "tokens"),
]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine = build_engine("atlas-tiny", backend="null", config=EngineConfig(max_seq_len=512))
    with serve_in_thread(engine) as s:
        yield s


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=30) as c:
        yield c


def assert_error_shape(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert "Traceback" not in error["message"] and "/atlas/" not in error["message"]
    assert error["param"] == param, error


@pytest.mark.parametrize(("path", "body", "status", "param"), CORPUS,
                         ids=[f"{i}-{p.strip('/').replace('/', '_')}" for i, (p, *_rest) in enumerate(CORPUS)])
def test_malformed_request_is_a_4xx_json_error(http: httpx.Client, path: str, body: bytes, status: int,
                                               param: str | None) -> None:
    for stream in (False, True):
        if stream and (b"stream_options" in body or path not in (COMPLETIONS, CHAT)):
            continue  # stream_options is only malformed without stream; /tokenize has no stream field
        payload = body
        if stream and body.startswith(b"{") and b'"stream"' not in body:
            payload = b'{"stream": true, ' + body[1:] if body != b"{}" else b'{"stream": true}'
        r = http.post(path, content=payload, headers={"content-type": "application/json"})
        assert_error_shape(r, status, param)
        if path in (COMPLETIONS, CHAT) and stream and not body.startswith(b"{"):
            break


def test_oversize_bodies_are_413(http: httpx.Client) -> None:
    big = _j({"prompt": "x" * (DEFAULT_MAX_BODY_BYTES + 10)})
    assert_error_shape(http.post(COMPLETIONS, content=big), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(DEFAULT_MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    r = http.post(COMPLETIONS, content=chunked(), headers={"content-type": "application/json"})
    assert_error_shape(r, 413)
    assert r.headers["connection"] == "close"  # the rest of that body is never read as a next request


def test_oversize_headers_are_431(http: httpx.Client) -> None:
    assert_error_shape(http.get("/v1/models", headers={"x-padding": "p" * 20_000}), 431)


def test_unknown_routes_and_methods(http: httpx.Client) -> None:
    assert_error_shape(http.get("/v1/nothing"), 404)
    r = http.get(COMPLETIONS)
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_server_keeps_serving_after_the_corpus(http: httpx.Client, served: Served) -> None:
    for path, body, _, _ in CORPUS:
        http.post(path, content=body)
    assert http.get("/health").status_code == 200
    r = http.post(COMPLETIONS, json={"prompt": "still here", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    stats = served.engine_loop.latest_stats
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0
