"""The state-digest audit mode, shared by every backend's StateStore (the CPU reference and the CUDA backend).

What the position stamps cannot see (bytes wrong at the right position: a restore that brings back some layers'
state, a commit that installs a rejected row's GDN state, drafter rows built from another hidden) the audit sees:
- every ring and prefix snapshot records a digest of the non-positional state it saves (`record`);
- every restore (ring, prefix) digests the state it installed and checks it against the record (`check`);
- a verify records each row's state digest and the target's hidden it computed (`record_verify`); its commit of
  `rows` rows checks the installed state against row rows - 1's digest (`check_commit`) and the hidden the
  drafter's pair keys are built from against the verify's (`check_hidden`).
A mismatch raises StateDigestMismatch, which the engine records as an InvariantViolation of machine
"StateDigest" at that step. Off by default (atlas.backends.base.state_audit_default): a store without an audit
(None) pays one attribute test per snapshot, restore and commit. How a state is digested is the backend's
(atlas.backends.cpu.digest, atlas.backends.cuda.store); `feed` is the byte encoding both use.
"""

from __future__ import annotations

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


class StateAudit:
    """The records of the audit mode and its checks (keys: ("ring", seq, ring slot) or ("prefix", key, 0))."""

    def __init__(self) -> None:
        self.saved: dict[tuple[str, int, int], str] = {}
        self.verified: dict[int, tuple[tuple[str, ...], torch.Tensor | None]] = {}  # seq -> row digests, hidden
        self.checks = 0  # digests compared (restores, commits, hiddens): the tests see the audit ran

    def record(self, key: tuple[str, int, int], digest: str) -> None:
        self.saved[key] = digest

    def check(self, seq_id: int, what: str, key: tuple[str, int, int], actual: str) -> None:
        """The installed state's digest against the snapshot's record (a snapshot recorded before the audit was
        on has none: nothing to check)."""
        recorded = self.saved.get(key)
        self.checks += recorded is not None
        if recorded is not None and actual != recorded:
            raise StateDigestMismatch(seq_id, what, recorded, actual)

    def record_verify(self, seq_id: int, rows: tuple[str, ...], hidden: torch.Tensor | None) -> None:
        """A verify ran: the digest of the state after each of its rows, and the target's hidden per row (kept
        apart from the pending verify, so a commit that installs anything else is seen)."""
        self.verified[seq_id] = (rows, None if hidden is None else hidden.detach().clone())

    def forget(self, seq_id: int) -> None:
        """The sequence's pending verify is gone (reset, release, a restore, a refused commit)."""
        self.verified.pop(seq_id, None)

    def take_verify(self, seq_id: int) -> tuple[tuple[str, ...], torch.Tensor | None] | None:
        return self.verified.pop(seq_id, None)

    def check_commit(self, seq_id: int, rows: int, verified: tuple[tuple[str, ...], Any] | None, actual: str) -> None:
        self.checks += verified is not None
        if verified is not None and actual != verified[0][rows - 1]:
            raise StateDigestMismatch(seq_id, f"verify commit of {rows} rows", verified[0][rows - 1], actual)

    def check_hidden(self, seq_id: int, rows: int, verified: tuple[tuple[str, ...], Any] | None,
                     built: torch.Tensor | None) -> None:
        """The hidden the committed drafter rows are built from is the one the verify computed for those rows."""
        if verified is None or verified[1] is None:
            return
        self.checks += 1
        if built is None or not torch.equal(built.to(verified[1].device), verified[1][:rows]):
            raise StateDigestMismatch(seq_id, "drafter rows of a verify commit", "the verify's hidden",
                                      "another hidden")
