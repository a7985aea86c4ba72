"""Rotary position embedding on the first `rotary_dim` features of each head (partial rotary).

Text-only serving: every mrope section sees the same text position, so mrope reduces to this.
"""

from __future__ import annotations

import torch

from atlas.backends.cpu.norms import acc_dtype


def rope_table(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [len(positions), rotary_dim] (frequencies repeated twice, rotate-half convention)."""
    acc = acc_dtype(dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(acc) / rotary_dim))
    freqs = positions.to(acc)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d], cos/sin [n, rotary_dim]: rotate the first rotary_dim features of every head."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)
