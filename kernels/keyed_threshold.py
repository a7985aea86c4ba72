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
SCAN_BLOCK = 1024  # bins a chunk: 64 chunk programs a row


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
def _chunk_kernel(counts_ptr, values_ptr, mass_ptr, sums_ptr, masses_ptr, lows_ptr, temp_ptr, lmp_ptr, zmax_ptr,
                  CHUNK: tl.constexpr):
    """Program (row, chunk of bins): each bin's mass over the min_p set (stored), the chunk's element count, mass
    and lowest bin in the min_p set."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    temp = tl.load(temp_ptr + row)
    t = tl.where(temp > 0.0, temp, 1.0)
    r = chunk * CHUNK + tl.arange(0, CHUNK)
    base = row.to(tl.int64) * 65536
    c = tl.load(counts_ptr + base + r)
    d = tl.load(values_ptr + r) / t - tl.load(zmax_ptr + row)  # z - z_max, as the reference's s - s[0]
    ok = (c > 0) & (d >= tl.load(lmp_ptr + row))
    mass = tl.where(ok, c.to(tl.float64) * tl.exp(tl.where(ok, d, 0.0)), 0.0)  # no overflow off the set
    tl.store(mass_ptr + base + r, mass)
    at = row * chunks + chunk
    tl.store(sums_ptr + at, tl.sum(c.to(tl.int64), axis=0))
    tl.store(masses_ptr + at, tl.sum(mass, axis=0))
    tl.store(lows_ptr + at, tl.max(tl.where(ok, r, -1), axis=0))


@triton.jit
def _threshold_kernel(counts_ptr, values_ptr, mass_ptr, sums_ptr, masses_ptr, lows_ptr, temp_ptr, topk_ptr,
                      topp_ptr, last_ptr, vocab, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Program per row: the top_k bin from the chunk counts then within its chunk, the kept mass, the top_p bin
    from the chunk masses then within its chunk; `last` = the chosen bin's value / T."""
    row = tl.program_id(0)
    temp = tl.load(temp_ptr + row)
    t = tl.where(temp > 0.0, temp, 1.0)
    top_k = tl.load(topk_ptr + row)
    k = tl.where(top_k > 0, tl.minimum(top_k, vocab), vocab)
    top_p = tl.load(topp_ptr + row)
    base = row.to(tl.int64) * 65536
    j = tl.arange(0, CHUNKS)
    sums = tl.load(sums_ptr + row * CHUNKS + j)
    masses = tl.load(masses_ptr + row * CHUNKS + j)
    low = tl.max(tl.load(lows_ptr + row * CHUNKS + j), axis=0)  # the lowest nonempty bin of the min_p set
    # top_k: the bin holding the k-th element (its whole tie is kept), found chunk first
    counted = tl.cumsum(sums, axis=0)
    chunk_k = tl.sum((counted < k).to(tl.int32), axis=0)
    ahead = tl.sum(tl.where(j < chunk_k, sums, 0), axis=0)
    r = tl.arange(0, CHUNK)
    c = tl.load(counts_ptr + base + chunk_k * CHUNK + r)
    bin_k = chunk_k * CHUNK + tl.sum(((ahead + tl.cumsum(c.to(tl.int64), axis=0)) < k).to(tl.int32), axis=0)
    lowest = tl.minimum(bin_k, low)  # the lowest kept bin: the threshold when top_p is off
    chosen = lowest
    if top_p < 1.0:
        # the kept mass by chunk: whole chunks above bin_k's, its part of that chunk, nothing below
        m_k = tl.load(mass_ptr + base + chunk_k * CHUNK + r)
        part = tl.sum(tl.where(chunk_k * CHUNK + r <= bin_k, m_k, 0.0), axis=0)
        kept = tl.where(j < chunk_k, masses, tl.where(j == chunk_k, part, 0.0))
        goal = top_p * tl.sum(kept, axis=0)
        cum = tl.cumsum(kept, axis=0)
        chunk_p = tl.minimum(tl.sum((cum < goal).to(tl.int32), axis=0), chunk_k)
        carry = tl.sum(tl.where(j < chunk_p, kept, 0.0), axis=0)
        m = tl.load(mass_ptr + base + chunk_p * CHUNK + r)
        bins = chunk_p * CHUNK + r
        m = tl.where(bins <= bin_k, m, 0.0)
        reached = (m > 0.0) & ((carry + tl.cumsum(m, axis=0)) >= goal)
        first = tl.min(tl.where(reached, bins, 65536), axis=0)
        # the sums by chunk and by bin round apart: not reached inside the chunk means at its last kept bin
        chosen = tl.where(first < 65536, first, tl.max(tl.where(m > 0.0, bins, -1), axis=0))
    tl.store(last_ptr + row, tl.load(values_ptr + chosen) / t)


_VALUES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def bin_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[65,536] float64: the value of each bin, largest first (the bit patterns of `dtype` in descending order;
    NaN patterns, which no bin receives, read as NaN)."""
    cached = _VALUES.get((dtype, device))
    if cached is None:
        # built on the device (no host copy: the first call may come inside a sampler graph's warm-up or a
        # sync-checked region)
        rank = torch.arange(BINS, dtype=torch.int64, device=device)
        code = 0xFFFF - rank
        u = torch.where(code >= 0x8000, code - 0x8000, 0xFFFF - code)
        bits = torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16)
        cached = _VALUES[(dtype, device)] = bits.view(dtype).to(torch.float64)
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
    chunks = BINS // scan_block
    mass = torch.empty(b, BINS, dtype=torch.float64, device=key.device)
    sums = torch.empty(b, chunks, dtype=torch.int64, device=key.device)
    masses = torch.empty(b, chunks, dtype=torch.float64, device=key.device)
    lows = torch.empty(b, chunks, dtype=torch.int32, device=key.device)
    last = torch.empty(b, dtype=torch.float64, device=key.device)
    values = bin_values(key.dtype, key.device)
    temperature = temperature.contiguous()
    _chunk_kernel[(b, chunks)](counts, values, mass, sums, masses, lows, temperature, log_min_p.contiguous(),
                               zmax.contiguous(), CHUNK=scan_block)
    _threshold_kernel[(b,)](counts, values, mass, sums, masses, lows, temperature, top_k.contiguous(),
                            top_p.contiguous(), last, vocab, CHUNK=scan_block, CHUNKS=chunks)
    return last
