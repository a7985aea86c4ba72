"""A digest of every state byte a sequence holds on the CPU backend (StateStore.state_digest): the KV rows of
positions 0 .. kv_tokens - 1 through its block table, the QSA raw keys, GDN conv + recurrent state, PLE context
+ short-conv state and the MTP drafter's rows. Equal digests mean equal states (BLAKE2b over the bytes)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch

from atlas.backends.audit import Parts, parts
from atlas.backends.audit import feed as _feed


def _recurrent(s: Any) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The non-positional state (a SequenceState's or a StateSnapshot's): GDN conv + recurrent, PLE context +
    short conv, named, in one fixed order."""
    for layer in sorted(s.gdn_conv):
        yield f"c{layer}", s.gdn_conv[layer]
        yield f"r{layer}", s.gdn_recurrent[layer]
    yield "pc", s.ple_context
    for layer in sorted(s.ple_conv):
        yield f"p{layer}", s.ple_conv[layer]


def sequence_digest(store: Any, seq_id: int, *, drafter: bool = True) -> str:
    """`store`: an atlas.backends.cpu.store.CpuStateStore (seqs, tables, kv, drafts)."""
    h = hashlib.blake2b(digest_size=16, person=b"atlas.state")
    s = store.seqs.get(seq_id)
    if s is None:
        return "absent"
    h.update(f"{s.kv_tokens}:{s.ssm_position}:{s.ple_position}".encode())
    table = store.tables.get(seq_id)
    if table is not None and s.kv_tokens:
        slots = store.kv.slots(table, 0, s.kv_tokens)
        for layer in sorted(store.kv.keys):
            k, v = store.kv.read(layer, slots)
            _feed(h, f"k{layer}", k)
            _feed(h, f"v{layer}", v)
    for layer in sorted(s.qsa_keys):
        _feed(h, f"q{layer}", s.qsa_keys[layer])
    for name, t in _recurrent(s):
        _feed(h, name, t)
    d = store.drafts.get(seq_id) if drafter else None
    if d is not None:
        h.update(f"d{d.first_key}:{d.rows}".encode())
        if d.rows:
            slots = torch.arange(d.rows)
            for layer in sorted(d.kv.keys):
                k, v = d.kv.read(layer, slots)
                _feed(h, f"dk{layer}", k)
                _feed(h, f"dv{layer}", v)
    return h.hexdigest()


def snapshot_digest(snap: Any) -> Parts:
    """The audit's digest of a StateSnapshot's (or a SequenceState's) non-positional bytes, part by part: GDN
    conv + recurrent, PLE context + short conv, and the positions they encode (the stamps)."""
    return parts([*_recurrent(snap), ("stamps", repr(sorted(snap.stamps.items())).encode())])
