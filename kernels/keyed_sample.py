"""The keyed sampler's draw in one pass over the logits: row keys, token words, Gumbel noise, the kept-set test and
the argmax, fused (reference: atlas.sampling.keyed.keyed_argmax_torch, which it must match token for token).

Per row: T > 0: argmax over {z - z_max >= log_min_p and z >= last} of z + g, z = float64(key) / T, g the Gumbel
noise of the row's (seed, position, salt) words; T == 0: argmax of key. The words are bit-identical to the torch
reference by construction (uint32 arithmetic wraps mod 2^32 here, as the reference's 32-bit limbs compute); z is
a correctly rounded float64 division in both; only the two float64 logs may differ (libdevice vs the host's libm,
within 1 ulp each).

The eager torch version runs ~60 passes over [B, V] int64/float64 tensors plus ~65 launches for the row keys:
~1 ms at B = 64, V = 65,536 on an H200 (about 3.5 GB of traffic) and ~0.15 ms of launches at B = 1. Here each
row is split over S programs (S chosen so B * S fills the GPU); each finds its chunk's best (value, lowest index)
and one torch argmax over the S partials keeps the lowest index among ties, so the split never changes a token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)

_CHAIN_A, _CHAIN_B = 0x243F_6A88, 0x85A3_08D3  # atlas.sampling.hashing's chain starts
BLOCK = 1024


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (atlas.sampling.hashing.mix32): products wrap mod 2^32."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x21F0AAAD, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x735A2D97, tl.uint32)
    return x ^ (x >> 15)


@triton.jit
def _row_key(start, s_lo, s_hi, p_lo, p_hi):
    k = _mix32(s_lo ^ start)
    k = _mix32(k ^ s_hi)
    k = _mix32(k ^ p_lo)
    return _mix32(k ^ p_hi)


@triton.jit
def _keyed_argmax_kernel(
    key_ptr, temp_ptr, lmp_ptr, last_ptr, zmax_ptr, seed_ptr, pos_ptr, best_val_ptr, best_idx_ptr,
    vocab, chunk, start_a, start_b, splits, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    lmp = tl.load(lmp_ptr + row)
    last = tl.load(last_ptr + row)
    zmax = tl.load(zmax_ptr + row)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    s_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    s_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    p_lo = (pos & 0xFFFFFFFF).to(tl.uint32)
    p_hi = ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32)
    ka = _row_key(start_a.to(tl.uint32), s_lo, s_hi, p_lo, p_hi)
    kb = _row_key(start_b.to(tl.uint32), s_lo, s_hi, p_lo, p_hi)
    sampled = temp > 0.0
    t_safe = tl.where(sampled, temp, 1.0)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab)
    best = tl.full((), -float("inf"), tl.float64)
    best_i = lo.to(tl.int64)
    base = key_ptr + row.to(tl.int64) * vocab
    for b in range(lo, hi, BLOCK):
        offs = b + tl.arange(0, BLOCK)
        inside = offs < hi
        x = tl.load(base + offs, mask=inside, other=-float("inf")).to(tl.float64)
        z = x / t_safe  # float64: PTX div.rn.f64, correctly rounded like the host
        w = _mix32(_mix32(ka ^ offs.to(tl.uint32)) ^ kb)
        u = (w.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # 2^-32: exact
        g = -tl.log(-tl.log(u))
        keep = ((z - zmax) >= lmp) & (z >= last) & inside
        score = tl.where(sampled, tl.where(keep, z + g, -float("inf")), tl.where(inside, x, -float("inf")))
        m = tl.max(score, axis=0)
        i = tl.min(tl.where(score == m, offs, hi), axis=0).to(tl.int64)
        better = m > best  # strictly: an earlier block (lower indices) keeps a tie
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, m, best)
    tl.store(best_val_ptr + row * splits + split, best)
    tl.store(best_idx_ptr + row * splits + split, best_i)


def keyed_argmax(key: torch.Tensor, temperature: torch.Tensor, log_min_p: torch.Tensor, last: torch.Tensor,
                 zmax: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, salt: int,
                 splits: int | None = None) -> torch.Tensor:
    """Tokens [B] int64. key [B, V] (float32/float64/bfloat16), the rest [B]: temperature/log_min_p/last/zmax
    float64 (zmax = float64(max key) / T), seed/position int64. No host synchronisation."""
    b, vocab = key.shape
    key = key.contiguous()
    if splits is None:  # enough programs to fill ~2 waves of a 132-SM GPU, at least one block each
        splits = max(1, min(triton.cdiv(vocab, BLOCK), triton.cdiv(264, max(b, 1))))
    chunk = triton.cdiv(triton.cdiv(vocab, splits), BLOCK) * BLOCK
    splits = triton.cdiv(vocab, chunk)
    best_val = torch.empty(b, splits, dtype=torch.float64, device=key.device)
    best_idx = torch.empty(b, splits, dtype=torch.int64, device=key.device)
    mask32 = 0xFFFF_FFFF
    _keyed_argmax_kernel[(b, splits)](
        key, temperature.contiguous(), log_min_p.contiguous(), last.contiguous(), zmax.contiguous(),
        seed.contiguous(), position.contiguous(), best_val, best_idx, vocab, chunk,
        (_CHAIN_A ^ salt) & mask32, (_CHAIN_B ^ salt) & mask32, splits, BLOCK=BLOCK)
    # the first split holding the maximum: the lowest index among ties, whatever the split
    return best_idx.gather(1, best_val.argmax(dim=1, keepdim=True))[:, 0]
