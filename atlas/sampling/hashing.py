"""The counter-based randomness of sampling: a keyed hash of (request seed, position, salt, token id) computed
with integer ops only, so the CPU and every GPU produce the same bits by construction.

The mixer is Wellons' `lowbias32` finaliser (xorshift-multiply, constants 0x21f0aaad / 0x735a2d97, shifts
16/15/15: a bijection of 32-bit words with avalanche bias 0.107, far below murmur3's fmix32). Values are
uint32 held in int64 tensors, and every 32x32-bit product is split into two 32x16-bit partial products
(< 2^48 each), so no step relies on signed int64 overflow (undefined in C++, the language of torch's kernels).

Keys: two independent 32-bit chains over (salt, seed mod 2^64 as two limbs, position as two limbs) give a
64-bit row key (ka, kb); token t's word is mix32(mix32(ka ^ t) ^ kb). Within a row distinct tokens get
distinct words (both steps are bijections); two rows' noise vectors are related only if ka1 ^ ka2 < vocab
AND kb1 == kb2 (probability ~ vocab / 2^64), which one 32-bit key would make ~ vocab / 2^32 (1.5e-5 at a
65,536 vocabulary: a few correlated position pairs per long generation).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFF_FFFF
_M1, _M2 = 0x21F0_AAAD, 0x735A_2D97
_CHAIN_A, _CHAIN_B = 0x243F_6A88, 0x85A3_08D3  # the two key chains' starting words (digits of pi)
_INV_2_32 = 2.0**-32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32): two partial products below 2^48, no int64 overflow."""
    hi = x * (c >> 16)
    hi.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    out = x * (c & 0xFFFF)
    return out.add_(hi).bitwise_and_(MASK32)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on uint32 values held in an int64 tensor (a new tensor; `x` is not modified)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x.bitwise_xor_(x >> 15)
    x = _mul32(x, _M2)
    return x.bitwise_xor_(x >> 15)


def mix32_int(x: int) -> int:
    """mix32 on a Python int with plain 64-bit products: the reference the tensor version is tested against."""
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    return x ^ (x >> 15)


def seed64(seed: int) -> int:
    """A request seed as the int64 a tensor holds: the seed mod 2^64, two's complement."""
    s = seed % (1 << 64)
    return s - (1 << 64) if s >= 1 << 63 else s


def row_keys(seed: torch.Tensor, position: torch.Tensor, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 64-bit key (ka, kb) [B] of each row from its seed and position ([B] int64) and a salt per use."""
    limbs = (seed & MASK32, (seed >> 32) & MASK32, position & MASK32, (position >> 32) & MASK32)
    # both chains in one [2, B] tensor: half the (tiny) launches; no host->device copy (capturable)
    k = mix32(torch.stack([limbs[0] ^ ((_CHAIN_A ^ salt) & MASK32), limbs[0] ^ ((_CHAIN_B ^ salt) & MASK32)]))
    for limb in limbs[1:]:
        k = mix32(k ^ limb[None])
    return k[0], k[1]


def key_ints(seed: int, position: int, salt: int) -> tuple[int, int]:
    """row_keys on Python ints (the reference for tests and the known-answer values)."""
    s, p = seed % (1 << 64), position % (1 << 64)
    limbs = (s & MASK32, s >> 32, p & MASK32, p >> 32)

    def chain(start: int) -> int:
        k = mix32_int(limbs[0] ^ ((start ^ salt) & MASK32))
        for limb in limbs[1:]:
            k = mix32_int(k ^ limb)
        return k

    return chain(_CHAIN_A), chain(_CHAIN_B)


def token_words(ka: torch.Tensor, kb: torch.Tensor, vocab: int) -> torch.Tensor:
    """The 32-bit word of every (row, token): [B, vocab] int64 in [0, 2^32)."""
    t = torch.arange(vocab, device=ka.device, dtype=torch.int64)
    x = mix32(ka[:, None] ^ t)
    return mix32(x.bitwise_xor_(kb[:, None]))


def word_int(seed: int, position: int, salt: int, token: int) -> int:
    ka, kb = key_ints(seed, position, salt)
    return mix32_int(mix32_int(ka ^ token) ^ kb)


def uniform(words: torch.Tensor) -> torch.Tensor:
    """(w + 0.5) / 2^32 in float64: exact (a 32-bit integer plus a half fits 53 bits), in (0, 1), never 0 or 1."""
    return words.to(torch.float64).add_(0.5).mul_(_INV_2_32)


def gumbel(words: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)) in float64 from the words. The two logs are the only operations
    whose result may differ between devices (libm vs CUDA's log, each within 1 ulp): ~1e-16 relative."""
    return uniform(words).log_().neg_().log_().neg_()
