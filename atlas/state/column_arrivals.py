"""A run of request arrivals at once, for `replay check`.

K consecutive RequestArrived rows (current version, JSON text) are checked as `requests.arrived` checks each one
(sequence ids in arrival order, request ids not live and not repeated, prompt + budget within capacity), their
Sequences built as `arrived` builds them, and the state digest after each of the K events computed over arrays:
every prompt's rolling token hash is one sum over all prompts (h = sum (t_i + 1) * FNV^(L-1-i) mod 2**64: the
recurrence h' = h * FNV + t + 1 from 0, unrolled), each new waiting sequence's fingerprint one mix over the K rows,
the sequences' share a cumulative XOR and the global share splitmix64 over the K events' sequence and queue counts.
Each digest is compared with the recorded one.

All or nothing: the state moves only when every arrival passes and every digest matches; otherwise nothing moves
(returns False) and the caller applies the rows one at a time, which refuses or reports exactly as without this.
A payload of any other shape (missing or extra keys, a non-int token or id, params SamplingParams refuses) goes
back the same way.
"""

from __future__ import annotations

import json
from itertools import chain

import numpy as np

from atlas.hashing import MASK64, fnv_powers
from atlas.sampling.params import SamplingParams
from atlas.state.columns import K_ID, K_LEN, digest_rounds, fingerprint_columns, mix64_column
from atlas.state.control import ControlState
from atlas.state.machines import Sequence

_U = np.uint64
_S20, _S32, _S40 = _U(20), _U(32), _U(40)
_KEYS = frozenset(("request_id", "seq_id", "prompt", "params", "max_new", "stream"))
_KEYS_NO_STREAM = _KEYS - {"stream"}  # stream defaults to False


def token_hashes(flat: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """roll_tokens(0, prompt) of each prompt: `flat` every prompt's tokens (int64) one after another, `lengths`
    each prompt's count (>= 1)."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    # token i of a prompt ending at e is multiplied by FNV^(e - 1 - i)
    exponent = np.repeat(ends - 1, lengths) - np.arange(len(flat))
    terms = flat.view(np.uint64) + _U(1)
    terms *= fnv_powers(int(lengths.max()))[exponent]
    return np.add.reduceat(terms, starts)


def waiting_fingerprints(token_hash: np.ndarray, seq_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """control.sequence_fingerprint of a sequence just arrived (waiting: nothing computed, no blocks, no ring,
    drafter rows, preemptions, rollbacks or latch): the hash and id round, then the token count's term."""
    return fingerprint_columns(token_hash ^ (seq_ids.view(np.uint64) * K_ID), lengths.view(np.uint64) * K_LEN)


def _parse(payloads: list[str]) -> tuple[list[dict], list[list[int]], np.ndarray] | None:
    """The payloads' dicts, each prompt list and every prompt's tokens as one int64 array; None for a payload that
    is not JSON, not a dict, or whose prompt is not a list of ints (the event's converter decides then, one at a
    time). Measured on the way: parsing the prompts apart (numpy's text parse of the joined lists, a regex to hold
    them to JSON's integer form, json.loads of the rest) cost more than json.loads of the whole payloads (6.1
    against 4.1 ms for benchmarks/replay_check.py's 256 arrivals): the rest of each payload is most of its parse.
    So did sharing one validated SamplingParams among requests that differ only in their seed (a key of the other
    fields and a field-by-field copy: 12.5 against 11.1 M instructions for the 256)."""
    loads = json.loads
    try:
        events = [loads(p) for p in payloads]
    except ValueError:
        return None
    prompts = []
    for d in events:
        prompt = d.get("prompt") if type(d) is dict else None
        if type(prompt) is not list or set(map(type, prompt)) != {int}:
            return None
        prompts.append(prompt)
    try:
        flat = np.fromiter(chain.from_iterable(prompts), np.int64, sum(map(len, prompts)))
    except OverflowError:
        return None
    return events, prompts, flat


# what a run of arrivals holds once parsed: request ids, sequence ids, prompts, every prompt's tokens (int64),
# budgets, stream flags, validated params
Parsed = tuple[list[str], list[int], list[list[int]], np.ndarray, list[int], list[bool], list[SamplingParams]]


def _parse_json(payloads: list[str]) -> Parsed | None:
    parsed = _parse(payloads)
    if parsed is None:
        return None
    events, prompts, flat = parsed
    for d in events:
        keys = d.keys()
        if keys != _KEYS and keys != _KEYS_NO_STREAM:
            return None
        if (type(d["request_id"]) is not str or type(d["seq_id"]) is not int or type(d["max_new"]) is not int
                or type(d.get("stream", False)) is not bool or type(d["params"]) is not dict):
            return None
    try:
        params = [SamplingParams.from_json(d["params"]) for d in events]
    except Exception:  # whatever it is, the per-event path meets it at its own event
        return None
    return ([d["request_id"] for d in events], [d["seq_id"] for d in events], prompts, flat,
            [d["max_new"] for d in events], [d.get("stream", False) for d in events], params)


def apply_arrivals(state: ControlState, payloads: list[str], digests: list[str] | None) -> bool:
    """Apply RequestArrived events of these JSON payloads in order, comparing the state digest after each with
    `digests` (None: not comparable). True: all applied. False: nothing moved."""
    return _fits(state) and apply_parsed(state, _parse_json(payloads), digests)


def _fits(state: ControlState) -> bool:
    caps = state.caps
    pool = state.pool
    # check_invariants would name one of these at the first arrival: the per-event path does
    return not (state.dead or caps.qsa_index_capacity < 0 or len(pool.free) + pool.used != pool.total
                or len(state.running) > caps.max_batch_size)


def apply_parsed(state: ControlState, parsed: Parsed | None, digests: list[str] | None) -> bool:
    """apply_arrivals of arrivals already parsed (`_parse_json`, or codec-1 payloads by atlas.replay.arrivals);
    None: they could not be (False, nothing moved)."""
    if parsed is None or not parsed[0] or not _fits(state):
        return False
    caps = state.caps
    pool = state.pool
    rids, sids, prompts, flat, budgets, streams, params = parsed
    k = len(rids)
    first = state.next_seq_id
    live = state.by_request
    seen: set[str] = set()
    lengths = []
    budget = caps.max_seq_len
    for n in range(k):
        rid, max_new, size = rids[n], budgets[n], len(prompts[n])
        if sids[n] != first + n or rid in live or rid in seen:
            return False
        if not size or size + max_new > budget or max_new < 1:
            return False
        seen.add(rid)
        lengths.append(size)
    size_col = np.array(lengths, dtype=np.int64)
    hashes = token_hashes(flat, size_col)
    ids = np.arange(first, first + k, dtype=np.int64)
    fps = waiting_fingerprints(hashes, ids, size_col)
    seqd = np.bitwise_xor.accumulate(fps)
    seqd ^= _U(state.seq_digest)
    if digests is not None:
        g = np.full(k, _U((state.step ^ (pool.used << 20)) & MASK64), dtype=np.uint64)  # ControlState.digest()
        g ^= (ids + 1).view(np.uint64) << _S40
        queues = np.arange(len(state.waiting) + 1, len(state.waiting) + k + 1, dtype=np.int64).view(np.uint64) << _S32
        queues ^= _U((len(state.running) ^ (state.finished_count << 16)) & MASK64)
        g = digest_rounds(g, queues,
                          _U(((len(state.pending_release) << 8) ^ len(state.pending_faults) ^ (state.dead << 62))
                             & MASK64), _U((state.inflight_hash ^ state.outcomes_hash) & MASK64))
        if state.prefix is not None:
            carried = -1 if state.carry is None else state.carry.last_pair_key
            g ^= _U((len(state.prefix.blocks) ^ (len(state.prefix.snapshots) << 24) ^ (carried << 40)) & MASK64)
            mix64_column(g)
        g ^= seqd
        if set(map(len, digests)) != {16} or g.astype(">u8").tobytes().hex() != "".join(digests):
            return False

    # every arrival holds: move the state as the K events would have
    step = state.step
    qcap, ratio, slots, mtp = caps.qsa_index_capacity, caps.qsa_ratio, caps.ring_slots, caps.drafter_rows > 0
    seqs, waiting = state.seqs, state.waiting
    arrive = Sequence.arrive
    for sid, rid, p, max_new, stream, prompt, h, fp in zip(sids, rids, params, budgets, streams, prompts,
                                                            hashes.tolist(), fps.tolist(), strict=True):
        seq = seqs[sid] = arrive(sid, rid, step, p, max_new, prompt, h, stream, qcap, ratio, slots, mtp)
        seq.fingerprint = fp
        live[rid] = sid
        waiting.append(sid)
    state.next_seq_id = first + k
    state.seq_digest = int(seqd[-1])
    return True
