"""A stored event row checked before anything trusts it: its payload decodes (JSON text, or codec 1's bytes), is an
object whose fields are exactly its event's (for the row's version, upcast to the current one), each of its field's
JSON type, and builds its event. A row that fails is a `BadRow` whose message says which field and why; the readers
turn it into a TraceFileError naming the file and the event (never a KeyError or TypeError from deep inside).

The checks follow each event class's field annotations (atlas.state.events), so a new field is checked as soon as
it is declared.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs

from atlas.errors import UnknownEvent
from atlas.replay.codec import decode
from atlas.sampling.params import SamplingParams
from atlas.state.events import EVENT_TYPES, Event, upcast


class BadRow(ValueError):
    """A row whose payload is not its event; the message says what is wrong (the reader names file and event)."""


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_ints(v: Any) -> bool:
    return type(v) in (list, tuple) and all(type(x) is int for x in v)


_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer", _is_int),
    "str": ("a string", lambda v: type(v) is str),
    "bool": ("true or false", lambda v: type(v) is bool),
    "str | None": ("a string or null", lambda v: v is None or type(v) is str),
    "tuple[int, ...]": ("a list of integers", _is_ints),
    "tuple[tuple[int, ...], ...]": ("a list of lists of integers",
                                    lambda v: type(v) in (list, tuple) and all(_is_ints(r) for r in v)),
    "dict[str, Any]": ("an object", lambda v: type(v) is dict),
}
_JSON_NAMES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
_FIELDS: dict[type, tuple[tuple[str, ...], tuple[str, ...], list[tuple[str, str, Callable[[Any], bool]]]]] = {}


def _fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...], list[tuple[str, str, Callable[[Any], bool]]]]:
    """(every field, the required ones, (field, what it must be, its test) for each annotation _CHECKS knows)."""
    known = _FIELDS.get(cls)
    if known is None:
        fields = attrs.fields(cls)
        names = tuple(f.name for f in fields)
        required = tuple(f.name for f in fields if f.default is attrs.NOTHING)
        tests = [(f.name, *_CHECKS[str(f.type)]) for f in fields if str(f.type) in _CHECKS]
        known = _FIELDS[cls] = (names, required, tests)
    return known


def check_payload(kind: str, version: int, payload: Any) -> dict[str, Any]:
    """`payload` (decoded, of `version`) upcast to the current version of `kind` and checked; raises BadRow."""
    if type(payload) is not dict:
        raise BadRow(f"its payload is a JSON {_JSON_NAMES.get(type(payload), type(payload).__name__)}, not an object")
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise BadRow(f"unknown event kind {kind!r}")
    if type(version) is not int or version < 1:
        raise BadRow(f"event version {version!r} is not a version")
    try:
        current = upcast(kind, version, payload)
    except UnknownEvent as exc:
        raise BadRow(str(exc)) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BadRow(f"its v{version} payload cannot be upcast to v{cls.version} ({type(exc).__name__}: {exc})"
                     ) from None
    names, required, tests = _fields(cls)
    missing = [n for n in required if n not in current]
    unknown = [n for n in current if n not in names]
    if missing or unknown:
        said = [f"lacks {', '.join(missing)}"] if missing else []
        said += [f"has unknown field(s) {', '.join(map(repr, unknown))}"] if unknown else []
        raise BadRow(f"its payload {' and '.join(said)}")
    for name, what, ok in tests:
        if name in current and not ok(current[name]):
            shown = json.dumps(current[name], default=repr)
            raise BadRow(f"field {name} is {shown[:60]}{'...' if len(shown) > 60 else ''}, not {what}")
    if kind == "request_arrived":
        try:
            SamplingParams.from_json(current["params"])
        except (TypeError, ValueError) as exc:
            raise BadRow(f"its params are not sampling parameters ({exc})") from None
    return current


def check_row(kind: Any, version: Any, raw: Any) -> dict[str, Any]:
    """A stored row's payload (JSON text or codec-1 bytes) decoded, upcast and checked; raises BadRow."""
    if type(kind) is not str:
        raise BadRow(f"its kind is {kind!r}, not a name")
    if type(version) is not int:
        raise BadRow(f"its version is {version!r}, not an integer")
    if type(raw) not in (str, bytes):
        raise BadRow(f"its payload is {type(raw).__name__}, neither JSON text nor a codec-1 blob")
    try:
        payload = decode(kind, version, raw)
    except UnknownEvent as exc:
        raise BadRow(str(exc)) from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRow(f"its payload is not JSON ({exc})") from None
    cls = EVENT_TYPES.get(kind)
    if type(raw) is bytes and kind != "request_arrived" and cls is not None and cls.version == version:
        return payload  # codec 1 decoded it whole: its layout's fields, every value an int32 (a third of show's read)
    return check_payload(kind, version, payload)


def check_event(kind: Any, version: Any, raw: Any) -> Event:
    """The checked row's event."""
    payload = check_row(kind, version, raw)
    try:
        return EVENT_TYPES[kind](**payload)
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadRow(f"its payload does not build a {kind} event ({exc})") from None
