"""An SSE event is one line to every client, whatever text it carries: the characters that JSON leaves raw and
str.splitlines-style line readers (httpx's iter_lines) break at are escaped."""

from __future__ import annotations

import json

import httpx

from atlas.server.generate import sse_data


def test_an_event_with_unicode_line_separators_stays_one_line() -> None:
    payload = {"choices": [{"text": "a\x85b\u2028c\u2029d\ne\r", "index": 0}], "model": "é"}
    event = sse_data(payload)
    lines = [line for line in httpx.Response(200, content=event).iter_lines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == payload
    assert "é".encode() in event  # not ASCII-escaped wholesale: only the line breakers are
