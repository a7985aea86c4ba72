"""Codec-1 arrivals (atlas.replay.codec's RequestArrived layout) parsed for replay check's arrivals at once
(atlas.state.column_arrivals.apply_parsed): the heads by struct, every prompt's int32s as one array, and the params
validated once per distinct text."""

from __future__ import annotations

import attrs
import numpy as np

from atlas.replay.codec import arrived_fields, params_with_seed
from atlas.sampling.params import SamplingParams
from atlas.state.column_arrivals import Parsed

_PARAM_FIELDS = tuple(a.name for a in attrs.fields(SamplingParams) if a.name != "seed")
_set = object.__setattr__
# (params text without the seed, the seed's place) -> (the SamplingParams first validated for it, its other fields)
ParamsCache = dict[tuple[bytes, int], tuple[SamplingParams, list[tuple[str, object]]]]


def params_of(cache: ParamsCache, text: bytes, seed_at: int, seed: int) -> SamplingParams:
    """SamplingParams.from_json of the recorded params (codec 1's text without the seed, the seed put back at
    `seed_at`), validated once per text: the seed has no validator or converter and enters no other field's check
    (SamplingParams' validators and __attrs_post_init__), so a request whose params differ from a validated one only
    in the seed gets that one's fields and its own seed (tested equal to from_json). Raises what from_json raises
    (ValueError for a text that is not the params' JSON object)."""
    hit = cache.get((text, seed_at))
    if hit is None:
        d = params_with_seed(text, seed_at, seed)
        if d is None:
            raise ValueError("not a params object")
        p = SamplingParams.from_json(d)
        cache[(text, seed_at)] = (p, [(n, getattr(p, n)) for n in _PARAM_FIELDS])
        return p
    p, fields = hit
    if seed_at < 0 or p.seed == seed:
        return p  # frozen: shared by every request with exactly these params
    q = object.__new__(SamplingParams)
    for n, v in fields:
        _set(q, n, v)
    _set(q, "seed", seed)
    return q


def parse_arrivals(payloads: list[bytes], cache: ParamsCache) -> Parsed | None:
    """Codec-1 arrivals (atlas.replay.codec): the heads by struct, every prompt's int32s as one array, the params
    validated once per distinct text (params_of)."""
    rids, sids, budgets, streams, params, chunks, lengths = [], [], [], [], [], [], []
    fields = arrived_fields
    try:
        for raw in payloads:
            f = fields(raw)
            if f is None:
                return None
            seq_id, max_new, seed, stream, seed_at, prompt, rid, text = f
            rids.append(rid)
            sids.append(seq_id)
            budgets.append(max_new)
            streams.append(stream)
            chunks.append(prompt)
            lengths.append(len(prompt) >> 2)
            params.append(params_of(cache, text, seed_at, seed))
    except Exception:  # what from_json raises: the per-event path meets it at its own event
        return None
    flat = np.frombuffer(b"".join(chunks), dtype="<i4").astype(np.int64)
    tokens = flat.tolist()
    prompts, at = [], 0
    for n in lengths:
        prompts.append(tokens[at:at + n])
        at += n
    return rids, sids, prompts, flat, budgets, streams, params
