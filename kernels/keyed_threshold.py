"""The keyed sampler's top-k / top-p / min-p threshold for 16-bit logits without a sort (reference:
atlas.sampling.keyed.threshold_sorted, whose `last` it must equal).

A bf16 (or fp16) row of V logits takes at most 65,536 distinct values, so the sorted row the reference scans is a
histogram over the 65,536 bit patterns in value order: every element of a bin has the same value, the bin's mass is
count x exp(z - z_max), and the k-th largest value, the smallest prefix reaching top_p of the mass and the min_p
cut are all found by scanning bins instead of elements. Two kernels:

- `_histogram_kernel` (grid rows x blocks of the vocabulary): each element's bin in descending value order,
  counted with integer atomics (integer adds commute: the counts never depend on the order the programs run in);
- `_threshold_kernel` (a program per row): pass 1 over the bins in value order: the running count (top_k: a bin
  is in while fewer than k elements precede it), the min_p cut, each kept bin's mass (stored) and the total; pass 2
  (top_p < 1 only): the running mass, the first kept bin where it reaches top_p x total. `last` is that bin's value
  / T, the value the reference returns (the same float64 division of the same exact value).

The sums run in a fixed order per row (block by block, tl.cumsum / tl.sum within a block), so a row's threshold
does not depend on the batch. They are not the reference's element-by-element cumsum: where the mass before a
token is within ~1e-15 relative of top_p x total the two may disagree on keeping it (the same bound the keyed
sampler already documents between devices). -0.0 counts as +0.0 (they are equal values); NaN logits are not
supported (nor are they by the sort, which orders them arbitrarily).

At B = 64, V = 65,536 the sort path costs ~0.6 ms on an H200 (sort, float64 cast, cumsum over [B, V]): the reason
seeded sampling missed its goal of 5% over greedy (issue 15).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)

BINS = 1 << 16
HIST_BLOCK = 1024
SCAN_BLOCK = 1024


@triton.jit
def _histogram_kernel(bits_ptr, counts_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    u = tl.load(bits_ptr + row * vocab + offs, mask=inside, other=0).to(tl.int32) & 0xFFFF
    u = tl.where(u == 0x8000, 0, u)  # -0.0 is +0.0
    # order-preserving code (0 = the most negative value), then its rank from the top: bin 0 = the largest
    code = tl.where(u >= 0x8000, 0xFFFF - u, u + 0x8000)
    rank = 0xFFFF - code
    tl.atomic_add(counts_ptr + row * 65536 + rank, tl.full((BLOCK,), 1, tl.int32), mask=inside)


@triton.jit
def _threshold_kernel(counts_ptr, values_ptr, mass_ptr, temp_ptr, lmp_ptr, topk_ptr, topp_ptr, zmax_ptr,
                      last_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temp = tl.load(temp_ptr + row)
    t = tl.where(temp > 0.0, temp, 1.0)
    lmp = tl.load(lmp_ptr + row)
    top_k = tl.load(topk_ptr + row)
    k = tl.where(top_k > 0, tl.minimum(top_k, vocab), vocab)
    top_p = tl.load(topp_ptr + row)
    zmax = tl.load(zmax_ptr + row)
    base = row.to(tl.int64) * 65536
    before = tl.zeros((), tl.int64)  # elements in the bins above this block
    total = tl.zeros((), tl.float64)
    lowest = tl.full((), -1, tl.int32)  # the lowest kept bin (top_p off: the threshold)
    for start in range(0, 65536, BLOCK):
        r = start + tl.arange(0, BLOCK)
        c = tl.load(counts_ptr + base + r)
        d = tl.load(values_ptr + r) / t - zmax  # z - z_max, as the reference's s - s[0]
        ahead = before + tl.cumsum(c.to(tl.int64), axis=0) - c  # elements in the bins above bin r
        kept = (ahead < k) & (c > 0) & (d >= lmp)
        mass = tl.where(kept, c.to(tl.float64) * tl.exp(tl.where(kept, d, 0.0)), 0.0)  # no overflow off the set
        tl.store(mass_ptr + base + r, mass)
        total += tl.sum(mass, axis=0)
        lowest = tl.maximum(lowest, tl.max(tl.where(kept, r, -1), axis=0))
        before += tl.sum(c.to(tl.int64), axis=0)
    chosen = lowest
    if top_p < 1.0:
        goal = top_p * total
        running = tl.zeros((), tl.float64)
        first = tl.full((), 65536, tl.int32)
        for start in range(0, 65536, BLOCK):
            r = start + tl.arange(0, BLOCK)
            mass = tl.load(mass_ptr + base + r)
            cum = running + tl.cumsum(mass, axis=0)
            first = tl.minimum(first, tl.min(tl.where((mass > 0.0) & (cum >= goal), r, 65536), axis=0))
            running = tl.max(cum, axis=0)
        chosen = tl.where(first < 65536, first, lowest)
    tl.store(last_ptr + row, tl.load(values_ptr + chosen) / t)


_VALUES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def bin_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[65,536] float64: the value of each bin, largest first (the bit patterns of `dtype` in descending order;
    NaN patterns, which no bin receives, read as NaN)."""
    cached = _VALUES.get((dtype, device))
    if cached is None:
        rank = torch.arange(BINS, dtype=torch.int64)
        code = 0xFFFF - rank
        u = torch.where(code >= 0x8000, code - 0x8000, 0xFFFF - code)
        bits = torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16)
        cached = _VALUES[(dtype, device)] = bits.view(dtype).to(torch.float64).to(device)
    return cached


def keyed_threshold(key: torch.Tensor, temperature: torch.Tensor, log_min_p: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, zmax: torch.Tensor, *, scan_block: int = SCAN_BLOCK) -> torch.Tensor:
    """`last` [B] float64 of atlas.sampling.keyed.threshold for 16-bit keys [B, V] (bf16 / fp16); the rest [B]:
    temperature / log_min_p / top_p float64, top_k int64, zmax = float64(max key) / T. No host synchronisation.
    scan_block: bins a step of the per-row scan (a power of two; the interpreted tests take larger ones)."""
    if key.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"keyed_threshold: 16-bit keys only (bfloat16 / float16), got {key.dtype}")
    b, vocab = key.shape
    bits = key.contiguous().view(torch.int16)
    counts = torch.zeros(b, BINS, dtype=torch.int32, device=key.device)
    _histogram_kernel[(b, triton.cdiv(vocab, HIST_BLOCK))](bits, counts, vocab, BLOCK=HIST_BLOCK)
    mass = torch.empty(b, BINS, dtype=torch.float64, device=key.device)
    last = torch.empty(b, dtype=torch.float64, device=key.device)
    _threshold_kernel[(b,)](counts, bin_values(key.dtype, key.device), mass, temperature.contiguous(),
                            log_min_p.contiguous(), top_k.contiguous(), top_p.contiguous(), zmax.contiguous(),
                            last, vocab, BLOCK=scan_block)
    return last
