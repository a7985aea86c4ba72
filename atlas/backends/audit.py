"""The state-digest audit mode, shared by every backend's StateStore (the CPU reference and the CUDA backend).

What the position stamps cannot see (bytes wrong at the right position: a restore that brings back some layers'
state, a commit that installs a rejected row's GDN state, drafter rows built from another hidden) the audit sees:
- every ring and prefix snapshot records a digest of the non-positional state it saves (`record`);
- every restore (ring, prefix) digests the state it installed and checks it against the record (`check`);
- a verify records each row's state digest and the target's hidden it computed (`record_verify`); its commit of
  `rows` rows checks the installed state against row rows - 1's digest (`check_commit`) and the hidden the
  drafter's pair keys are built from against the verify's (`check_hidden`).
A digest is `Parts`: one short BLAKE2b per named part of the state (a layer's GDN conv, its recurrent state, the
PLE context, the stamps), so a mismatch names the parts that differ. The names are what the violation records:
the hex digests of float state depend on the CPU's kernels (the same trace gives other bytes on another ISA),
the names of what differs do not, so a failure-library trace replays to the same event on any machine.
A mismatch raises StateDigestMismatch, which the engine records as an InvariantViolation of machine
"StateDigest" at that step. Off by default (atlas.backends.base.state_audit_default): a store without an audit
(None) pays one attribute test per snapshot, restore and commit. How a state is digested is the backend's
(atlas.backends.cpu.digest, atlas.backends.cuda.store); `feed` is the byte encoding both use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from atlas.errors import StateDigestMismatch


def feed(h: Any, name: str, t: torch.Tensor | None) -> None:
    """Name, shape and raw bytes of `t` into hash `h` (a tensor on any device; None hashes as absent)."""
    h.update(name.encode())
    if t is None:
        h.update(b"-")
        return
    t = t.detach().contiguous().cpu()
    h.update(str(tuple(t.shape)).encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


Parts = tuple[tuple[str, str], ...]  # (part name, its digest), in a fixed order


def parts(named: Iterable[tuple[str, torch.Tensor | bytes | None]]) -> Parts:
    """A digest per named tensor (name, shape and bytes; `feed`) or byte string."""
    out = []
    for name, t in named:
        h = hashlib.blake2b(digest_size=8, person=b"atlas.part")
        if isinstance(t, bytes):
            h.update(name.encode() + b"=" + t)
        else:
            feed(h, name, t)
        out.append((name, h.hexdigest()))
    return tuple(out)


def differing(recorded: Parts, actual: Parts) -> tuple[str, ...]:
    """The names of the parts whose digests differ (a part present in one only counts as differing)."""
    a, b = dict(recorded), dict(actual)
    return tuple(n for n in dict.fromkeys([*a, *b]) if a.get(n) != b.get(n))


class StateAudit:
    """The records of the audit mode and its checks (keys: ("ring", seq, ring slot) or ("prefix", key, 0))."""

    def __init__(self) -> None:
        self.saved: dict[tuple[str, int, int], Parts] = {}
        self.verified: dict[int, tuple[tuple[Parts, ...], torch.Tensor | None]] = {}  # seq -> row digests, hidden
        self.checks = 0  # digests compared (restores, commits, hiddens): the tests see the audit ran

    def record(self, key: tuple[str, int, int], digest: Parts) -> None:
        self.saved[key] = digest

    def check(self, seq_id: int, what: str, key: tuple[str, int, int], actual: Parts) -> None:
        """The installed state's digest against the snapshot's record (a snapshot recorded before the audit was
        on has none: nothing to check)."""
        recorded = self.saved.get(key)
        self.checks += recorded is not None
        if recorded is not None and actual != recorded:
            raise StateDigestMismatch(seq_id, what, differing(recorded, actual))

    def record_verify(self, seq_id: int, rows: tuple[Parts, ...], hidden: torch.Tensor | None) -> None:
        """A verify ran: the digest of the state after each of its rows, and the target's hidden per row (kept
        apart from the pending verify, so a commit that installs anything else is seen)."""
        self.verified[seq_id] = (rows, None if hidden is None else hidden.detach().clone())

    def forget(self, seq_id: int) -> None:
        """The sequence's pending verify is gone (reset, release, a restore, a refused commit)."""
        self.verified.pop(seq_id, None)

    def take_verify(self, seq_id: int) -> tuple[tuple[Parts, ...], torch.Tensor | None] | None:
        return self.verified.pop(seq_id, None)

    def check_commit(self, seq_id: int, rows: int, verified: tuple[tuple[Parts, ...], Any] | None, actual: Parts) -> None:
        self.checks += verified is not None
        if verified is not None and actual != verified[0][rows - 1]:
            raise StateDigestMismatch(seq_id, f"verify commit of {rows} rows", differing(verified[0][rows - 1], actual))

    def check_hidden(self, seq_id: int, rows: int, verified: tuple[tuple[Parts, ...], Any] | None,
                     built: torch.Tensor | None) -> None:
        """The hidden the committed drafter rows are built from is the one the verify computed for those rows."""
        if verified is None or verified[1] is None:
            return
        self.checks += 1
        if built is None or not torch.equal(built.to(verified[1].device), verified[1][:rows]):
            raise StateDigestMismatch(seq_id, "drafter rows of a verify commit", ("hidden",))
