"""StepExecuted's advance of a step without drafts in one pass: check, commit, invariant test and fingerprint.

steps._advance_all checks every sequence in one pass and commits them in a second, so that a refusal leaves the
state as it was. This pass does both per sequence and, when a later sequence cannot take the common path (a
condition of check_advance fails, it is gone, its QSA keys are not its computed count, its drafter is MTP), puts
back exactly what it moved for the sequences before it (computed, QSA keys, the appended token and the token hash,
whose step is inverted: the FNV prime is odd, so it has an inverse mod 2**64) and gives the event to the two-pass
path, which refuses naming the sequence or handles it, as before. Fingerprints and the digest are written only
once every sequence passed. At batch 64 the second walk (a tuple per sequence, every cursor read again) was about
a quarter of StepExecuted's apply (benchmarks/control_plane.py).
"""

from __future__ import annotations

from atlas.hashing import MASK64
from atlas.state.control import ControlState, common_fingerprint, fold_fingerprints, sequence_fingerprint
from atlas.state.events import StepPlanned
from atlas.state.invariants import holds as _holds
from atlas.state.machines import Phase, Sequence

_FNV = 0x100000001B3
_FNV_INVERSE = pow(_FNV, -1, 1 << 64)  # (h * FNV + t + 1) * ... undone: h = (h' - t - 1) * FNV^-1 mod 2**64


def advance_fused(state: ControlState, plan: StepPlanned, tokens: tuple[int, ...], bs: int,
                  vector_min: int) -> list[int] | None:
    """The suspects (steps._advance_all's return), or None having moved nothing: the caller's two passes then
    run. Only for prefix caching off (register_blocks has no undo here)."""
    seqs = state.seqs
    get = seqs.get
    running = Phase.RUNNING
    M = MASK64
    vector = len(plan.seqs) >= vector_min
    suspects: list[int] = []
    scalar: list[tuple[Sequence, int]] = []  # (sequence, fingerprint) written after the pass
    v_rows: list[tuple[Sequence, int, int, int, int, int]] = []  # running_fingerprints' columns, one row each
    v_add = v_rows.append
    k = 0
    for seq_id, fed, token in zip(plan.seqs, plan.fed, tokens, strict=True):
        seq = get(seq_id)
        if seq is None:
            _undo(state, plan, tokens, k)
            return None
        c = seq.cursor
        computed = c.computed
        end = computed + fed
        toks = c.tokens
        n = len(toks)
        q = seq.qsa
        d = seq.drafter
        blocks = len(seq.blocks)
        # check_advance's conditions, and what the undo needs (QSA keys at computed, no MTP drafter to follow)
        if (c.phase is not running or fed < 1 or end > n or end > q.capacity or end > blocks * bs
                or ((end != n or n - c.prompt_len >= seq.max_new) if token >= 0 else end == n)
                or q.ingested != computed or d.mtp):
            _undo(state, plan, tokens, k)
            return None
        k += 1
        c.computed = end
        q.ingested = end
        th = c.token_hash
        if token >= 0:
            toks.append(token)
            n += 1
            th = c.token_hash = (th * _FNV + token + 1) & M
        if seq.ring.snapshots or seq.rollbacks or d.rows or d.carried:  # the rare fields: the functions themselves
            scalar.append((seq, sequence_fingerprint(seq)))
            if not _holds(seq, bs, 0):
                suspects.append(seq_id)
            continue
        # _holds's conditions for this case (no snapshots, no drafter rows, not MTP, not carried)
        pl = c.prompt_len
        if (end < 0 or end > n or pl > n or n - pl > seq.max_new or q.ingested != end or end > q.capacity
                or c.phase is not running or end > blocks * bs or (blocks - 1) * bs >= max(n, 1)):
            suspects.append(seq_id)
        if vector and not seq.preemptions and not d.latched:  # (running: checked above)
            v_add((seq, th, seq_id, n, end, blocks))
            continue
        # sequence_fingerprint without its rare-field round (no snapshots, no rollbacks, no drafter rows)
        scalar.append((seq, common_fingerprint(th, seq_id, n, end, c.phase, blocks, seq.preemptions, d.latched)))
    acc = state.seq_digest
    for seq, fp in scalar:
        acc ^= seq.fingerprint ^ fp
        seq.fingerprint = fp
    fold_fingerprints(state, acc, v_rows)
    return suspects


def _undo(state: ControlState, plan: StepPlanned, tokens: tuple[int, ...], k: int) -> None:
    """Put back what the pass moved for the plan's first k sequences (each passed, so each is live, its QSA keys
    were its computed count, and its token, if any, is the last one of its list)."""
    M = MASK64
    seqs = state.seqs
    for seq_id, fed, token in zip(plan.seqs[:k], plan.fed, tokens, strict=False):
        seq = seqs[seq_id]
        c = seq.cursor
        c.computed -= fed
        seq.qsa.ingested = c.computed
        if token >= 0:
            c.tokens.pop()
            c.token_hash = ((c.token_hash - token - 1) * _FNV_INVERSE) & M
