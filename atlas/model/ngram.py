"""PLE n-gram hashing tables: per-head prime vocabulary sizes, offsets and the per-layer multipliers.

They are derived from the config alone (checkpoints also store them as buffers; the loader checks the two
agree), so both backends compute the same n-gram ids from the same token history.
"""

from __future__ import annotations

import math
from functools import lru_cache

import attrs
import torch

from atlas.model.spec import PleSpec

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_LAYER_STRIDE = 10007  # a prime: each PLE layer hashes with its own multipliers


@attrs.frozen
class NgramTables:
    multipliers: tuple[int, ...]  # one odd multiplier per shift 0..ngram_size-1
    head_vocab_sizes: tuple[int, ...]  # a distinct prime per n-gram head
    head_offsets: tuple[int, ...]  # each head's first row in the concatenated embedding table
    padded_rows: int  # rows of the concatenated table, padded to vocab_divisible_by

    def multipliers_tensor(self) -> torch.Tensor:
        return torch.tensor(self.multipliers, dtype=torch.long)


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _M1) & _MASK64
    value = ((value ^ (value >> 27)) * _M2) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def _next_prime(after: int) -> int:
    p = after + 1
    while not _is_prime(p):
        p += 1
    return p


@lru_cache(maxsize=64)
def ngram_tables(ple: PleSpec, vocab_size: int, ple_index: int) -> NgramTables:
    """Tables of the `ple_index`-th PLE layer (its rank among PLE layers, not its decoder layer index)."""
    # multipliers stay below max_long // vocab so token * multiplier never overflows int64
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base_seed = ple.seed + _LAYER_STRIDE * ple_index
    multipliers = tuple(
        2 * (_splitmix64((base_seed + _GAMMA * (shift + 1)) & _MASK64) % half_bound) + 1
        for shift in range(ple.ngram_size)
    )
    # head h of layer l takes the (l * heads + h + 1)-th prime above vocab_base - 1
    prime = ple.vocab_base - 1
    for _ in range(ple_index * ple.num_heads):
        prime = _next_prime(prime)
    sizes, offsets, total = [], [], 0
    for _ in range(ple.num_heads):
        prime = _next_prime(prime)
        sizes.append(prime)
        offsets.append(total)
        total += prime
    padded = math.ceil(total / ple.vocab_divisible_by) * ple.vocab_divisible_by
    return NgramTables(multipliers, tuple(sizes), tuple(offsets), padded)


def shifted_history(history: torch.Tensor, shift: int, eos: int) -> torch.Tensor:
    """token[p - shift] for each p, or EOS when an EOS lies in tokens[p - shift .. p - 1].

    `history` [T] starts with the carried context (ngram_size - 1 ids, EOS-filled at a sequence's start),
    so the n-gram context restarts after every EOS and never reads before the sequence.
    """
    if shift == 0:
        return history
    n = history.shape[0]
    pos = torch.arange(n)
    eos_pos = torch.where(history == eos, pos, torch.full_like(pos, -1))
    last_eos_before = torch.cat([torch.full((1,), -1), torch.cummax(eos_pos, dim=0).values[:-1]])
    source = pos - shift
    valid = (source >= 0) & (source > last_eos_before)
    shifted = history[source.clamp_min(0)]
    return torch.where(valid, shifted, torch.full_like(history, eos))


def ngram_ids(history: torch.Tensor, num_new: int, ple: PleSpec, tables: NgramTables) -> torch.Tensor:
    """Row ids into the concatenated n-gram table for the last `num_new` positions: [num_new, num_heads]."""
    history = history.long()
    shifted = [shifted_history(history, s, ple.eos_token_id) for s in range(ple.ngram_size)]
    mult = tables.multipliers
    sizes = torch.tensor(tables.head_vocab_sizes, dtype=torch.long)
    offsets = torch.tensor(tables.head_offsets, dtype=torch.long)
    blocks = []
    mixed = shifted[0] * mult[0]
    for order in range(2, ple.ngram_size + 1):
        mixed = torch.bitwise_xor(mixed, shifted[order - 1] * mult[order - 1])
        lo = (order - 2) * ple.heads_per_ngram
        hi = lo + ple.heads_per_ngram
        blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes[lo:hi]) + offsets[lo:hi])
    return torch.cat(blocks, dim=-1)[-num_new:]
