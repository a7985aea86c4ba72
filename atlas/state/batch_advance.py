"""StepExecuted over the engine's batch columns (atlas.state.batch_columns): the commit of the plan `fits` accepted,
checked for every row as one expression, written through to the objects and the columns, with the fingerprints.
A mixin of `BatchColumns`, whose columns it reads and writes (every one of them defined there)."""

from __future__ import annotations

import numpy as np

from atlas.hashing import MASK64
from atlas.state.columns import K_COMPUTED_QSA, fingerprint_columns, step_rows

_U = np.uint64
_I = np.int64
_K_TOKEN_STEP = _U((0xC2B2AE3D27D4EB4F + int(K_COMPUTED_QSA)) & MASK64)  # the terms' move for one decoded token
# the decode step's constants as 0-d arrays (columns.mix64_column's note: ~0.2 us less a ufunc call than a scalar's)
_A_FNV, _A_ONE, _A_TOKEN_STEP = np.array(_U(0x100000001B3)), np.array(_U(1)), np.array(_K_TOKEN_STEP)
_A_ONE_I = np.array(1, _I)


class BatchAdvance:
    """BatchColumns' StepExecuted (no state of its own)."""

    __slots__ = ()

    def advance(self, tokens: tuple[int, ...]) -> int | None:
        """StepExecuted of the plan `fits` accepted: Sequence.check_advance's conditions for every row and `_holds`'s
        on the state the commit leaves as one expression, then the commit written through to the objects and the
        columns, and the fingerprints. Returns the XOR of old and new fingerprints (the digest's change), or None
        having moved nothing when any condition fails (the scalar path then refuses, or commits and names its
        suspects, exactly as without columns). The fed counts >= 1 were checked by StepPlanned; running,
        qsa.ingested == computed and no snapshots or drafter rows hold for every row by construction."""
        fed = self.fed
        assert fed is not None
        if not tokens:
            return None
        known = self.token_range
        if known is not None and known[0] is tokens:  # outcome's min and max of these very tokens
            lo, top = known[1], known[2]
        else:
            lo, top = min(tokens), max(tokens)
        if lo < -(1 << 63) or top >= 1 << 63:
            return None
        tok = np.fromiter(tokens, _I, len(tokens))  # np.array's values (ints within int64, tested above), ~0.2 us less
        n = self.ntok
        th = self.token_hash
        slack = None
        if self.decode and lo >= 0:  # every row fed its last token (end == n) and sampled one
            # the conditions below with end == n and every token sampled: KV and QSA keys within the blocks and the
            # index, the new token within the budget, no block past the tokens: n <= hi and n >= low on every row,
            # i.e. both minima of slack_bounds >= 0 (kept across decode steps: no numpy call for them)
            slack = self.slack or self.slack_bounds()
            if slack[0] < 0 or slack[1] < 0:
                return None
            end = n
            ends = self.ntok_values()  # the token counts before it: the list the outcome's walk took (one tolist)
            n2 = n + _A_ONE_I
            some_unsampled = False
            th = th * _A_FNV
            th += tok.view(_U)
            th += _A_ONE
            terms = self.terms + _A_TOKEN_STEP  # one more token and one more computed: the terms move by a constant
            slack = (slack[0] - 1, slack[1] + 1, slack[2] - 1)  # every row's token count one more
        else:
            end = self.computed + fed
            moved = step_rows(n, end, tok, self.limit, self.budget_end, self.low, th, self.blocks_term)
            if moved is None:
                return None
            n2, th, terms, some_unsampled = moved
            ends = end.tolist()
        h = fingerprint_columns(th ^ self.hid, terms)
        change = int(np.bitwise_xor.reduce(self.fp ^ h))
        hashes, fps = th.tolist(), h.tolist()
        if some_unsampled:
            for c, q, seq, x, t, th_, fp in zip(self.cursors, self.qsas, self.objs, ends, tokens, hashes, fps,
                                                strict=True):
                c.computed = x
                q.ingested = x
                if t >= 0:
                    c.tokens.append(t)
                    c.token_hash = th_
                seq.fingerprint = fp
            self.last = None
        else:  # (strict=False, ~0.4 us less at 64: StepExecuted checked one token per planned row and the plan's rows are
            # these; the row lists and the columns always have the rows' length)
            for c, q, seq, x, t, th_, fp in zip(self.cursors, self.qsas, self.objs, ends, tokens, hashes, fps,
                                                strict=False):
                c.computed = x
                q.ingested = x
                c.tokens.append(t)
                c.token_hash = th_
                seq.fingerprint = fp
            self.last = list(tokens)
        self.next_decode = not some_unsampled  # each sampled: end == n, so one token (the new one) is left to feed
        self.ends, self.computed, self.ntok, self.token_hash, self.fp, self.terms = ends, end, n2, th, h, terms
        self.short = None
        self.slack = slack
        self.fed = None
        self.decode = False
        self.token_range = None
        return change
