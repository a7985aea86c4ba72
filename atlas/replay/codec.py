"""The trace's event payloads: JSON text for every event, or a binary form for the step events and arrivals (codec 1).

A step event (StepPlanned v3, StepExecuted v2) is 64 integers and more per step at batch 64, and most of a
trace; as JSON, reading one back (json.loads, then the event's converters turning lists into tuples) cost more
than replay check's whole per-event budget at 100,000 events/s. Codec 1 stores
such a payload as a BLOB: one byte `CODEC`, then little-endian int32s, each variable-length field as its length
and its values, in field order (an event with a value outside int32 is stored as JSON):

    step_planned v3:   step, admitted*, seqs*, fed[len(seqs)], alloc**, release*, reset*, drafts**, restored*
    step_executed v2:  step, tokens*, accepted*, verdicts*
    (x* = len, values; x** = number of rows, then each row as x*)

A request arrival (RequestArrived v2: as JSON, its parse and SamplingParams' validation were
~37 M of a 231 M-instruction check of benchmarks/replay_check.py's trace) is a fixed head, the prompt as int32s, then
text: codec byte, seed (int64), seq_id, max_new, stream, seed_at, len(prompt), len(request id), len(params) (int32s),
prompt, the request id (UTF-8), and the params without their seed as compact JSON (UTF-8); `seed_at` is the seed's
place among the params' keys (-1: the params have none), so the decoded dict is the recorded one, key order
included. Requests that share their params but for the seed share that text: replay check validates it once
(atlas.state.column_arrivals). An arrival whose seed is not an int64, whose prompt has a token past int32 or whose
text will not encode as UTF-8 stays JSON.

A payload is text (JSON) or bytes (this codec): the reader tells them apart per row, so a trace may hold both
(an edited or imported row is JSON) and every trace recorded before codec 1 reads as it always did. The row's
event version says which layout the bytes hold; a later version of a step event gets its own layout here (the
old ones stay), and upcasting runs on the decoded payload as for JSON. Only the SQLite store writes codec 1.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Callable
from typing import Any

from atlas.errors import UnknownEvent
from atlas.state.events import EVENT_TYPES, Event, RequestArrived, StepExecuted, StepPlanned, upcast

CODEC = 1
_HEAD = bytes([CODEC])
if array("i").itemsize != 4:  # the C int is 32 bits on every platform CPython supports; say so if not
    raise ImportError(f"atlas.replay.codec needs a 4-byte array('i'), this platform's is {array('i').itemsize}")
_LITTLE = sys.byteorder == "little"
_set = object.__setattr__


def _ints(a: array, values: tuple[int, ...]) -> None:
    a.append(len(values))
    a.extend(values)


def _rows(a: array, rows: tuple[tuple[int, ...], ...]) -> None:
    a.append(len(rows))
    for row in rows:
        a.append(len(row))
        a.extend(row)


def _encode_planned(e: StepPlanned) -> array:
    a = array("i", (e.step, len(e.admitted)))
    a.extend(e.admitted)
    a.append(len(e.seqs))
    a.extend(e.seqs)
    a.extend(e.fed)
    _rows(a, e.alloc)
    _ints(a, e.release)
    _ints(a, e.reset)
    _rows(a, e.drafts)
    _ints(a, e.restored)
    return a


def _encode_executed(e: StepExecuted) -> array:
    a = array("i", (e.step, len(e.tokens)))
    a.extend(e.tokens)
    _ints(a, e.accepted)
    _ints(a, e.verdicts)
    return a


_ENCODERS: dict[type, Callable[[Any], array]] = {StepPlanned: _encode_planned, StepExecuted: _encode_executed}


# RequestArrived v2's head: codec, seed, seq_id, max_new, stream, seed_at, len(prompt), len(request id), len(params)
ARRIVED = struct.Struct("<Bq7i")
_INT32 = range(-(1 << 31), 1 << 31)
_INT64 = range(-(1 << 63), 1 << 63)
_COMPACT = json.JSONEncoder(separators=(",", ":")).encode  # the events' own JSON form (Event.payload_json)


def _encode_arrived(e: RequestArrived) -> bytes | None:
    params = e.params
    if (type(params) is not dict or type(e.request_id) is not str or type(e.seq_id) is not int
            or type(e.max_new) is not int or type(e.stream) is not bool
            or e.seq_id not in _INT32 or e.max_new not in _INT32):
        return None
    seed = params.get("seed", 0)
    seed_at = list(params).index("seed") if "seed" in params else -1
    if type(seed) is not int or seed not in _INT64:
        return None
    try:
        prompt = array("i", e.prompt)
        rid = e.request_id.encode()
        text = _COMPACT({k: v for k, v in params.items() if k != "seed"}).encode()
    except (OverflowError, TypeError, ValueError, UnicodeEncodeError):
        return None
    if not _LITTLE:
        prompt.byteswap()
    return (ARRIVED.pack(CODEC, seed, e.seq_id, e.max_new, e.stream, seed_at, len(prompt), len(rid), len(text))
            + prompt.tobytes() + rid + text)


def arrived_fields(raw: bytes) -> tuple[int, int, int, bool, int, bytes, str, bytes] | None:
    """(seq_id, max_new, seed, stream, seed_at, prompt's int32 bytes, request id, params text without the seed) of a
    codec-1 RequestArrived v2, or None when the bytes are not one (lengths that do not add up, a stream flag other
    than 0 or 1, a seed_at out of place, a request id that is not UTF-8)."""
    if len(raw) < ARRIVED.size or raw[0] != CODEC:
        return None
    _, seed, seq_id, max_new, stream, seed_at, n, nr, npar = ARRIVED.unpack_from(raw)
    a = ARRIVED.size + 4 * n
    b = a + nr
    if n < 0 or nr < 0 or npar < 0 or b + npar != len(raw) or stream not in (0, 1) or seed_at < -1:
        return None
    try:
        rid = raw[a:b].decode()
    except UnicodeDecodeError:
        return None
    return seq_id, max_new, seed, stream == 1, seed_at, raw[ARRIVED.size:a], rid, raw[b:]


def params_with_seed(text: bytes, seed_at: int, seed: int) -> dict[str, Any] | None:
    """The recorded params dict: `text` (JSON, without the seed) with the seed put back at its place; None when
    `text` is not a JSON object or the place is past its keys."""
    try:
        d = json.loads(text)
    except ValueError:
        return None
    if type(d) is not dict or seed_at > len(d) or "seed" in d:
        return None
    if seed_at < 0:
        return d
    items = list(d.items())
    items.insert(seed_at, ("seed", seed))
    return dict(items)


def _decode_arrived(version: int, raw: bytes) -> dict[str, Any]:
    fields = arrived_fields(raw)
    params = None if fields is None else params_with_seed(fields[7], fields[4], fields[2])
    if fields is None or params is None:
        raise UnknownEvent(f"request_arrived v{version}: a malformed codec-{CODEC} payload ({len(raw)} bytes)")
    seq_id, max_new, _seed, stream, _at, prompt, rid, _text = fields
    a = array("i")
    a.frombytes(prompt)
    if not _LITTLE:
        a.byteswap()
    return {"request_id": rid, "seq_id": seq_id, "prompt": a.tolist(), "params": params, "max_new": max_new,
            "stream": stream}


def encode(e: Event) -> bytes | None:
    """Codec 1's bytes for a step event or an arrival of the current version; None for any other event (stored as
    JSON)."""
    if type(e) is RequestArrived:
        return _encode_arrived(e) if e.version == _ARRIVED_VERSION else None
    enc = _ENCODERS.get(type(e))
    if enc is None:
        return None
    try:
        a = enc(e)
    except OverflowError:  # a value past int32 (never at today's sizes): this one event stays JSON
        return None
    if not _LITTLE:
        a.byteswap()
    return _HEAD + a.tobytes()


class _Reader:
    """Fields off the decoded integers, in order; an overrun or leftover is a malformed payload."""

    __slots__ = ("v", "i")

    def __init__(self, v: list[int]) -> None:
        self.v = v
        self.i = 0

    def one(self) -> int:
        x = self.v[self.i]
        self.i += 1
        return x

    def ints(self, n: int | None = None) -> tuple[int, ...]:
        if n is None:
            n = self.one()
        i = self.i
        self.i = j = i + n
        if n < 0 or j > len(self.v):
            raise IndexError(j)
        return tuple(self.v[i:j])

    def rows(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.ints() for _ in range(self.one()))


def _planned(r: _Reader) -> tuple[Any, ...]:
    step = r.one()
    admitted = r.ints()
    seqs = r.ints()
    return (step, admitted, seqs, r.ints(len(seqs)), r.rows(), r.ints(), r.ints(), r.rows(), r.ints())


def _executed(r: _Reader) -> tuple[Any, ...]:
    """_Reader's walk written out: this is half of a trace's events (~1.5 us against ~3.5 a call)."""
    v = r.v
    n = v[1]
    i = 2 + n
    k = v[i]
    j = i + 1 + k
    m = v[j]
    end = j + 1 + m
    if n < 0 or k < 0 or m < 0:
        raise IndexError(end)
    r.i = end
    return (v[0], tuple(v[2:i]), tuple(v[i + 1:j]), tuple(v[j + 1:end]))


# (kind, version) -> (field names of that version, decoder); the event class of that kind is built directly
_DECODERS: dict[tuple[str, int], tuple[tuple[str, ...], Callable[[_Reader], tuple[Any, ...]]]] = {
    ("step_planned", 3): (("step", "admitted", "seqs", "fed", "alloc", "release", "reset", "drafts", "restored"),
                          _planned),
    ("step_executed", 2): (("step", "tokens", "accepted", "verdicts"), _executed),
}


_ARRIVED_VERSION = 2  # the RequestArrived version codec 1 has a layout for


def _values(kind: str, version: int, raw: bytes) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    spec = _DECODERS.get((kind, version))
    if not raw or raw[0] != CODEC or spec is None:
        raise UnknownEvent(f"{kind} v{version}: a binary payload of codec {raw[0] if raw else None} that this "
                           f"engine cannot read (it reads codec {CODEC} for {sorted(_DECODERS)})")
    a = array("i")
    body = memoryview(raw)[1:]
    if len(body) % 4:
        raise UnknownEvent(f"{kind} v{version}: a codec-{CODEC} payload of {len(raw)} bytes (1 + 4 per integer)")
    a.frombytes(body)
    if not _LITTLE:
        a.byteswap()
    r = _Reader(a.tolist())
    try:
        values = spec[1](r)
    except IndexError:
        values = None
    if values is None or r.i != len(r.v):
        raise UnknownEvent(f"{kind} v{version}: a malformed codec-{CODEC} payload ({len(r.v)} integers)")
    return spec[0], values


def decode(kind: str, version: int, raw: str | bytes) -> dict[str, Any]:
    """The payload as recorded (that version's fields, JSON values: lists, not tuples), never upcast."""
    if isinstance(raw, str):
        return json.loads(raw)
    if kind == "request_arrived" and version == _ARRIVED_VERSION and raw[:1] == _HEAD:
        return _decode_arrived(version, raw)
    names, values = _values(kind, version, raw)
    return {n: [list(x) for x in v] if n in ("alloc", "drafts") else list(v) if isinstance(v, tuple) else v
            for n, v in zip(names, values, strict=True)}


def load_event(kind: str, version: int, raw: str | bytes) -> Event:
    """The event of a stored payload, upcast to the current version. A codec-1 payload of the current version
    becomes its event without the JSON dict or the field converters (its values are int tuples already)."""
    cls = EVENT_TYPES.get(kind)
    if cls is not None and isinstance(raw, bytes) and cls.version == version and kind != "request_arrived":
        names, values = _values(kind, version, raw)
        e = object.__new__(cls)
        for n, v in zip(names, values, strict=True):
            _set(e, n, v)
        return e
    payload = decode(kind, version, raw)
    if cls is None or cls.version != version:
        payload = upcast(kind, version, payload)
    return EVENT_TYPES[kind](**payload)
