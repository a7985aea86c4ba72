"""The cursor arithmetic of a run of step events (atlas.state.column_runs): every row's cursors after every event
of R StepPlanned / StepExecuted pairs as [steps x batch] numpy expressions, checked as the per-event path checks
them, and the batch's fingerprints after each. Computed, token count and block count are cumulative sums; the
token hash is its recurrence in closed form (`token_hash_rows`); a chunk every row decodes through takes no
cumulative sums at all (`_decode_chunk`). Pure: reads the step columns, moves nothing."""

from __future__ import annotations

import numpy as np

from atlas.state.columns import K_BLOCKS, K_RUNNING, StepColumns, mix_columns

_U = np.uint64
_FNV = _U(0x100000001B3)

# the run's [steps x batch] arithmetic goes this many elements at a time: a larger temporary (past ~128 KB) is
# handed back to the OS by glibc's malloc when freed and faults its pages in again on the next one (measured: two
# uint64 ops over 382 x 64 took 240-440 us in one expression, 13 us over 150 x 64; MALLOC_TRIM_THRESHOLD_ unset)
CHUNK_ELEMENTS = 4096
_FNV_INV = _U(pow(0x100000001B3, -1, 1 << 64))  # FNV's prime is odd: a unit mod 2**64


def _powers(base: np.uint64, n: int) -> np.ndarray:
    p = np.full(n, base, dtype=np.uint64)
    p[0] = 1
    return np.cumprod(p, dtype=np.uint64)


def token_hash_rows(h0: np.ndarray, sampled: np.ndarray, tokens: np.ndarray, out: np.ndarray) -> None:
    """The rolling token hash of each row after each of a chunk of steps (out[k]: after step k), from h0 before
    it: a sampled token t maps h to h * FNV + t + 1, an unsampled one leaves it. With c_k the sampled count up to
    step k, that is h_k = FNV^c_k * (h0 + sum_{j<=k} FNV^-c_j * (t_j + 1) [t_j sampled]), exact mod 2**64 (FNV is
    odd, so a unit: every partial product has its inverse): a cumulative sum and a table gather, ~8 numpy calls a
    chunk. The step-at-a-time recurrence it replaces was 2 ufunc calls and 3 subscripts a step (~320 numpy calls a
    64-step chunk)."""
    c = np.cumsum(sampled, axis=0)
    steps = len(sampled) + 1
    inv = _powers(_FNV_INV, steps)[c]
    add = np.where(sampled, tokens.astype(np.int64) + 1, 0).view(np.uint64)  # int32 blobs: t + 1 in int64
    add *= inv
    np.cumsum(add, axis=0, out=add)
    add += h0
    np.multiply(_powers(_FNV, steps)[c], add, out=out)


# a chunk whose every row is fed 1 token and samples one at every step (a decode) goes _decode_chunk's way (False: every
# chunk the general way; the tests compare the two)
DECODE_CHUNKS = True
_POWERS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _step_tables(m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Columns [m x 1] of 1..m, FNV^1..FNV^m and FNV^-1..FNV^-m (mod 2**64), made once per chunk length."""
    t = _POWERS.get(m)
    if t is None:
        t = _POWERS[m] = (np.arange(1, m + 1, dtype=np.int64)[:, None], _powers(_FNV, m + 1)[1:, None],
                          _powers(_FNV_INV, m + 1)[1:, None])
    return t


def _decode_chunk(comp: np.ndarray, ntok: np.ndarray, th: np.ndarray, nb: np.ndarray, fp: np.ndarray,
                  cap: np.ndarray, budget: np.ndarray, hid: np.ndarray, Fc: np.ndarray, Tc: np.ndarray,
                  Gc: np.ndarray, bs: int) -> tuple | None:
    """run_cursors' chunk when every row is fed 1 and samples a token at every step of it, and every row starts with
    every known token but one computed (a decode): computed after X_k is comp + k + 1, the token count ntok + k + 1,
    the count before X_k equals computed (so the sampling condition holds), and the bounds on computed and the token
    count hold at every step when they hold at the chunk's last (both only grow): the general chunk's conditions,
    with only the two on the blocks left [steps x batch]. The token hash's closed form with c_k = k + 1 takes no
    gathers. None when any of this does not hold (the general chunk then decides, which refuses what fails);
    otherwise the cursors after the chunk, the XOR of the fingerprints after each X_k, and the [steps x batch]
    token hashes (row 0: before the chunk), fingerprints (the same), computed counts and block counts."""
    m = len(Fc)
    if not ((Fc == 1).all() and (Tc >= 0).all() and (ntok == comp + 1).all() and (comp + m <= cap).all()
            and (ntok + m <= budget).all()):
        return None
    K, P, Q = _step_tables(m)
    C = K + comp  # computed after X_k, and the token count before it
    # KV within the blocks and no block past the tokens, (NB - 1) * bs < C <= NB * bs with NB = nb + cumsum(G) the
    # blocks after P_k, is NB == ceil(C / bs) (C >= 1): each plan's blocks the step's rise of ceil(C / bs), from nb
    # (no cumulative sum over the steps, a shift for a power-of-two block size)
    NB = C + (bs - 1)
    if bs & (bs - 1):
        NB //= bs
    else:
        NB >>= bs.bit_length() - 1
    if not ((NB[0] - nb == Gc[0]).all() and (NB[1:] - NB[:-1] == Gc[1:]).all()):
        return None
    TH = np.empty((m + 1, len(comp)), dtype=np.uint64)
    TH[0] = th
    add = Tc.astype(np.int64)  # int32 blobs: t + 1 in int64
    add += 1
    add = add.view(np.uint64)
    add *= Q
    np.cumsum(add, axis=0, out=add)
    add += th
    np.multiply(P, add, out=TH[1:])
    terms = NB.view(np.uint64) * K_BLOCKS
    terms += K_RUNNING
    FX = np.empty((m + 1, len(comp)), dtype=np.uint64)
    FX[0] = fp
    FX[1:] = mix_columns(TH[1:] ^ hid, C + 1, C, terms)
    sx = np.bitwise_xor.reduce(FX[1:], axis=1)
    return C[-1], ntok + m, TH[-1], NB[-1], FX[-1], sx, TH, FX, C, NB


def run_cursors(cols: StepColumns, F: np.ndarray, T: np.ndarray, G: np.ndarray, kk: np.ndarray, rr: np.ndarray,
             bs: int, seq_x: np.ndarray, delta_p: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Every row's cursors after every event of the run, checked, and fingerprinted: seq_x[k] the XOR of the
    batch's fingerprints after X_k, delta_p[k] what P_k's new blocks change in it. A chunk of steps at a time
    (CHUNK_ELEMENTS); returns the cursors after the last event (computed, token count, token hash, fingerprint,
    blocks), or None when a condition fails."""
    R, n = F.shape
    step = max(1, CHUNK_ELEMENTS // n)
    comp, ntok, th, nb, fp = cols.computed, cols.ntok, cols.token_hash, cols.nblocks, cols.fp
    cap, budget, hid = cols.capacity, cols.budget_end, cols.hid
    cuts = np.searchsorted(kk, np.arange(0, R + step, step)).tolist()
    for ci, c0 in enumerate(range(0, R, step)):
        c1 = min(R, c0 + step)
        Fc, Tc = F[c0:c1], T[c0:c1]
        if DECODE_CHUNKS:
            got = _decode_chunk(comp, ntok, th, nb, fp, cap, budget, hid, Fc, Tc, G[c0:c1], bs)
            if got is not None:
                comp, ntok, th, nb, fp, sx, TH, FX, C, NB = got
                seq_x[c0:c1] = sx
                a, b = cuts[ci], cuts[ci + 1]
                if b > a:  # as below: NTb is C (ntok == comp + 1), the fed counts are 1
                    k, r = kk[a:b] - c0, rr[a:b]
                    f = k * n  # [k, r] of the [steps x batch] arrays as one flat index (a 1-D take, no 2-D mapiter)
                    f += r
                    terms = NB.ravel().take(f).view(np.uint64) * K_BLOCKS
                    terms += K_RUNNING
                    Cf = C.ravel().take(f)
                    new = mix_columns(TH.ravel().take(f) ^ hid.take(r), Cf, Cf - 1, terms)
                    new ^= FX.ravel().take(f)
                    np.bitwise_xor.at(delta_p, k + c0, new)
                continue
        S = Tc >= 0
        C = np.cumsum(Fc, axis=0, dtype=np.int64)
        C += comp  # computed after X_k
        NT = np.cumsum(S, axis=0, dtype=np.int64)
        NT += ntok  # token count after X_k
        NTb = NT - S  # before it
        NB = np.cumsum(G[c0:c1], axis=0)
        NB += nb  # blocks after P_k
        KV = NB * bs
        # StepPlanned's work (fed >= 1, within the tokens and the blocks) and its alloc'd rows' invariants (checked
        # for every row: one that did not move held them after X_{k-1}), then StepExecuted's advance and the
        # invariants on what it moved: sampled exactly when every known token is fed, KV and QSA keys within the
        # blocks and the index, the tokens within the budget, no block past them
        if not ((Fc >= 1) & (C <= NTb) & (S == (C == NTb)) & (C <= KV) & (C <= cap) & (NT <= budget)
                & (KV - bs < NTb)).all():
            return None
        # token hashes: h' = h * FNV + t + 1 for a sampled token (h' = h otherwise), in closed form over the chunk
        TH = np.empty((c1 - c0 + 1, n), dtype=np.uint64)
        TH[0] = th
        token_hash_rows(th, S, Tc, TH[1:])
        terms = NB.view(np.uint64) * K_BLOCKS
        terms += K_RUNNING
        FX = np.empty((c1 - c0 + 1, n), dtype=np.uint64)  # row 0: the fingerprints before the chunk
        FX[0] = fp
        FX[1:] = mix_columns(TH[1:] ^ hid, NT, C, terms)
        seq_x[c0:c1] = np.bitwise_xor.reduce(FX[1:], axis=1)
        a, b = cuts[ci], cuts[ci + 1]
        if b > a:  # P_k's rows with new blocks: their fingerprint on X_{k-1}'s cursors with P_k's blocks
            k, r = kk[a:b] - c0, rr[a:b]
            before = TH[k, r] ^ hid[r]
            new = mix_columns(before, NTb[k, r], C[k, r] - Fc[k, r], terms[k, r])
            new ^= FX[k, r]
            np.bitwise_xor.at(delta_p, k + c0, new)
        comp, ntok, th, nb, fp = C[-1], NT[-1], TH[-1], NB[-1], FX[-1]
    return comp.copy(), ntok.copy(), th.copy(), fp.copy(), nb.copy()
