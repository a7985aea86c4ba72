"""Columnar step state: the scalar cursors of one step's sequences held in numpy columns between events.

`ControlState.columnar` (set by `atlas replay check`, which owns its state: nothing but `apply` reads or writes
it) lets StepPlanned gather the plan's sequences into a `StepColumns` once, after which every StepPlanned /
StepExecuted pair over the same sequences is checked, committed, tested against the invariants and fingerprinted
as ~30 numpy operations over the batch instead of a Python loop over its sequences. The `Sequence` objects stay the
typed state: the columns are written back into them (`flush`) before any other event, before any refusal or
invariant report (so every message names the sequence and numbers exactly as the scalar path does), and when the
replay ends. Only sequences on the common path are gathered (running, no ring snapshots, rollbacks, preemptions,
drafter rows, MTP, carry or latch, prefix caching off): anything else keeps the scalar path.

Measured (benchmarks/replay_check.py's trace, 64 sequences a step): benchmarks/replay_check.py.
"""

from __future__ import annotations

import numpy as np

from atlas.state.machines import Phase, Sequence

_U = np.uint64
_I = np.int64
K_ID, _K_MIX1, _K_MIX2 = _U(0x9E3779B97F4A7C15), _U(0xBF58476D1CE4E5B9), _U(0x94D049BB133111EB)
_S30, _S27, _S31 = _U(30), _U(27), _U(31)
K_LEN, K_BLOCKS = _U(0xC2B2AE3D27D4EB4F), _U(0xFF51AFD7ED558CCD)
K_COMPUTED_QSA = _U((0x165667B19E3779F9 + 0xC4CEB9FE1A85EC53) & 0xFFFFFFFFFFFFFFFF)
_M64 = (1 << 64) - 1
K_RUNNING = _U(0xD6E8FEB86659FD93 * Phase.RUNNING & _M64)
_FINISHED = Phase.FINISHED
_FNV, _ONE = _U(0x100000001B3), _U(1)
try:  # the C function under np.count_nonzero: ~1.0 K instructions a call against ndarray.all()'s ~8.5 K (numpy 2.4,
    # 64 rows, callgrind): the bool reductions of a decode step over the engine's batch columns
    from numpy._core.multiarray import count_nonzero
except ImportError:  # numpy 1.x
    count_nonzero = np.count_nonzero


def common(seq: Sequence) -> bool:
    """The sequence is on the path the columns model (its fingerprint is running_fingerprints' form)."""
    c = seq.cursor
    d = seq.drafter
    return (c.phase is Phase.RUNNING and not seq.ring.snapshots and not seq.rollbacks and not seq.preemptions
            and not d.rows and not d.mtp and not d.carried and not d.latched and seq.qsa.ingested == c.computed)


def plain_advance(n: np.ndarray, end: np.ndarray, unsampled: np.ndarray, limit: np.ndarray, budget_end: np.ndarray,
                  low: np.ndarray) -> np.ndarray | None:
    """The token counts after a step (n + 1 where a token was sampled) when every row's advance is the plain one,
    else None: sampled exactly when every known token is fed (end == n; end < n otherwise), KV and QSA keys within
    the blocks and the index, the token within the budget, no block past the tokens."""
    n2 = n + ~unsampled
    left = n - end
    if not (((left > 0) == unsampled) & (left >= 0) & (end <= limit) & (n2 <= budget_end) & (n2 > low)).all():
        return None
    return n2


def step_rows(n: np.ndarray, end: np.ndarray, tok: np.ndarray, limit: np.ndarray, budget_end: np.ndarray,
              low: np.ndarray, token_hash: np.ndarray, blocks_term: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool] | None:
    """A draft-free step's advance of running rows in columns (the engine's batch columns and the replay's step
    columns): rows with `n` tokens fed up to `end`, `tok` each one's sampled token (-1: none). (the token counts
    after, the token hashes after, the fingerprint terms after, whether a row sampled nothing), or None when a row
    is off the plain path (plain_advance's conditions): nothing computed then, the caller's per-sequence path
    refuses or names it."""
    unsampled = tok < 0
    n2 = plain_advance(n, end, unsampled, limit, budget_end, low)
    if n2 is None:
        return None
    th = token_hash * _FNV + (tok.view(_U) + _ONE)
    some_unsampled = bool(unsampled.any())
    if some_unsampled:
        th = np.where(unsampled, token_hash, th)
    return n2, th, n2.view(_U) * K_LEN + end.view(_U) * K_COMPUTED_QSA + blocks_term, some_unsampled


def mix_columns(h: np.ndarray, seq_len: np.ndarray, computed: np.ndarray, blocks_term: np.ndarray) -> np.ndarray:
    """fingerprint_columns of running sequences (qsa.ingested == computed): `h` the token hash ^ seq_id * K (left as
    it is), `blocks_term` the running phase's and the block count's terms."""
    # int64 columns >= 0: their uint64 view is the same number
    return fingerprint_columns(h.copy(), seq_len.view(_U) * K_LEN + computed.view(_U) * K_COMPUTED_QSA + blocks_term)


# mix64_column's constants as 0-d uint64 arrays: a ufunc with a 0-d array operand takes ~0.27 us at 64 rows against
# ~0.45 us with a numpy scalar (the scalar's conversion on every call; numpy 2.4, timeit); the same values and dtype
_A_MIX1, _A_MIX2 = np.array(_K_MIX1), np.array(_K_MIX2)
_A30, _A27, _A31 = np.array(_S30), np.array(_S27), np.array(_S31)


_RS, _BX, _MUL = np.right_shift, np.bitwise_xor, np.multiply


def mix64_column(h: np.ndarray) -> np.ndarray:
    """atlas.hashing.mix64 over a uint64 column (in place; uint64 wraps where the scalar masks). The ufuncs called
    with their output array (no `^=` / `*=`: the operator's dispatch is ~25 ns a call more) and one temporary for the
    three shifts (one array allocated, not three): ~10% less at 64 rows (1.64 against 1.84 us, timeit; session 15)."""
    t = _RS(h, _A30)
    if type(t) is not np.ndarray:  # a 0-d array or a numpy scalar (no column): the operators, as before
        h ^= t
        h *= _A_MIX1
        h ^= h >> _A27
        h *= _A_MIX2
        h ^= h >> _A31
        return h
    _BX(h, t, h)
    _MUL(h, _A_MIX1, h)
    _RS(h, _A27, t)
    _BX(h, t, h)
    _MUL(h, _A_MIX2, h)
    _RS(h, _A31, t)
    _BX(h, t, h)
    return h


def digest_rounds(a: np.ndarray, b: np.ndarray | np.uint64, c: np.ndarray | np.uint64,
                  d: np.ndarray | np.uint64) -> np.ndarray:
    """ControlState.digest()'s four mixing rounds over uint64 columns, one event a row (before its prefix round and
    the sequences' XOR): `a` (a fresh column, mixed in place) the step, pool and id counters, then `b` the queue
    counts, `c` the release, fault and dead fields, `d` the in-flight plan's and the outcomes' hashes, each XORed in
    and mixed (replay check's runs, arrivals and lazy digests)."""
    mix64_column(a)
    a ^= b
    mix64_column(a)
    a ^= c
    mix64_column(a)
    a ^= d
    return mix64_column(a)


def fingerprint_columns(h: np.ndarray, terms: np.ndarray) -> np.ndarray:
    """control.sequence_fingerprint over uint64 columns for sequences without its rare fields (ring snapshots,
    rollbacks): `h` the token hash ^ seq_id * K (a fresh column, mixed in place), `terms` the sum of the field terms
    (token count, computed, phase, blocks, QSA keys, drafter rows, preemptions, latch; the ones at 0 left out).
    uint64 arithmetic wraps mod 2**64 where the scalar form masks; tested against it (tests/test_state_batched.py)."""
    mix64_column(h)
    h += terms
    return mix64_column(h)


class StepColumns:
    """The columns of the sequences `ids` (one step's plan order). The objects hold the values of the last
    flush; the columns hold the current ones (`tokens`: the sampled-token rows since then, -1 = none)."""

    __slots__ = ("ids", "objs", "row", "bs", "computed", "ntok", "token_hash", "nblocks", "capacity", "fp", "fed",
                 "tokens", "hid", "budget_end", "limit", "low", "blocks_term", "gone", "prior")

    def __init__(self, ids: tuple[int, ...], objs: list[Sequence], bs: int) -> None:
        self.ids = ids
        self.objs = objs
        self.row = {s: i for i, s in enumerate(ids)}
        self.bs = bs
        cur = [s.cursor for s in objs]
        self.hid = np.array(ids, dtype=_U) * K_ID
        self.computed = np.array([c.computed for c in cur], dtype=_I)
        self.ntok = np.array([len(c.tokens) for c in cur], dtype=_I)
        self.token_hash = np.array([c.token_hash for c in cur], dtype=_U)
        self.nblocks = np.array([len(s.blocks) for s in objs], dtype=_I)
        self.capacity = np.array([s.qsa.capacity for s in objs], dtype=_I)
        self.fp = np.array([s.fingerprint for s in objs], dtype=_U)
        self.fed: np.ndarray | None = None  # the in-flight plan's fed counts (set by StepPlanned)
        self.tokens: list[np.ndarray] = []
        # rows whose sequence finished since (atlas.state.column_batch: the batch changes in place); the columns
        # they left, with their pending tokens, flushed first (`prior`)
        self.gone: set[int] = set()
        self.prior: StepColumns | None = None
        # derived once (the checks' bounds, the fingerprint's constant terms), moved with the block counts
        self.budget_end = np.array([c.prompt_len + s.max_new for c, s in zip(cur, objs, strict=True)], dtype=_I)
        self.limit = np.minimum(self.capacity, self.nblocks * bs)  # KV and QSA keys end within both
        self.low = (self.nblocks - 1) * bs  # the tokens reach past this (no block beyond them)
        self.blocks_term = self.nblocks.astype(_U) * K_BLOCKS + K_RUNNING

    def add_blocks(self, r: int, k: int) -> None:
        """Row r's sequence got k blocks (StepPlanned's alloc)."""
        b = int(self.nblocks[r]) + k
        self.nblocks[r] = b
        self.limit[r] = min(int(self.capacity[r]), b * self.bs)
        self.low[r] = (b - 1) * self.bs
        self.blocks_term[r] = (b * 0xFF51AFD7ED558CCD + 0xD6E8FEB86659FD93 * Phase.RUNNING) & _M64

    @classmethod
    def gather(cls, seqs: dict[int, Sequence], ids: tuple[int, ...], bs: int) -> StepColumns | None:
        """The columns of `ids` (live sequences), or None when one of them is off the common path."""
        objs = [seqs[s] for s in ids]
        if not all(map(common, objs)):
            return None
        return cls(ids, objs, bs)

    def flush(self) -> None:
        """Write the columns back into the sequences (every field they moved). `tokens` holds one row per step
        (a step's tokens) or one [steps x batch] block per run (atlas.state.column_runs); -1: none sampled."""
        if self.prior is not None:  # the earlier rows' tokens first (this flush then writes the current fields)
            self.prior.flush()
            self.prior = None
        objs = self.objs
        computed_c, hash_c, fp_c = self.computed, self.token_hash, self.fp
        # a row whose sequence finished since (atlas.state.column_batch) is not written: its object left the state
        # (nothing reads it again), and its tokens were most of a flush's cost (the replay's last flush is all such)
        live = [i for i, s in enumerate(objs) if s.cursor.phase is not _FINISHED]
        if len(live) != len(objs):
            if not live:
                self.tokens = []
                return
            objs = [objs[i] for i in live]
            computed_c, hash_c, fp_c = computed_c[live], hash_c[live], fp_c[live]
        logged = None
        if self.tokens:
            block = np.vstack(self.tokens)
            if len(live) != len(self.objs):
                block = block[:, live]
            skipped = (block < 0).any(axis=0).tolist()
            logged = block.T.tolist()
        for i, (seq, computed, h, fp) in enumerate(zip(objs, computed_c.tolist(), hash_c.tolist(), fp_c.tolist(),
                                                       strict=True)):
            c = seq.cursor
            c.computed = computed
            seq.qsa.ingested = computed
            c.token_hash = h
            seq.fingerprint = fp
            if logged is not None:
                if skipped[i]:
                    c.tokens.extend(t for t in logged[i] if t >= 0)
                else:  # every step sampled this row's token (a decode): the row as it is
                    c.tokens.extend(logged[i])
        self.tokens = []
