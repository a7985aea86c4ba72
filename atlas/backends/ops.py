"""The model math both backends share, device-agnostic torch: normalisations (computed in at least fp32, as
transformers does, then cast back), rotary embeddings, the hyper-connection injection and the dense MLP.
Each backend arranges the rest (per-token or batched, eager or fused) around these."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: fp32 for fp32 and below, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int | None = None) -> torch.Tensor:
    """Zero-centred RMSNorm, x * rsqrt(mean(x^2) + eps) * (1 + w); over groups of `group` features if set."""
    y = x.to(acc_dtype(x.dtype))
    if group is not None:
        y = y.reshape(*y.shape[:-1], -1, group)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if group is not None:
        y = y.flatten(-2)
    return (y * (1.0 + weight.to(y.dtype))).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act: str) -> torch.Tensor:
    """GDN's output norm: plain (not zero-centred) RMSNorm times act(gate)."""
    acc = acc_dtype(x.dtype)
    y = x.to(acc)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(x.dtype)
    g = gate.to(acc)
    g = F.silu(g) if act == "silu" else torch.sigmoid(g)
    return (y * g).to(x.dtype)


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def rope_table(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [len(positions), rotary_dim] (frequencies repeated twice, rotate-half convention), on the
    positions' device. Text-only serving: every mrope section sees the same text position, so mrope reduces
    to this partial rotary on the first `rotary_dim` features of each head."""
    acc = acc_dtype(dtype)
    idx = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).to(acc)
    inv_freq = 1.0 / (theta ** (idx / rotary_dim))
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


def hyper_inject(streams: torch.Tensor, block_out: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """Add the block output [..., H] to every stream, weighted per stream by inject [..., hc]."""
    return streams + (block_out.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)


def dense_mlp(w: dict[str, torch.Tensor], pre: str, x: torch.Tensor) -> torch.Tensor:
    gate = x @ w[pre + "gate_proj.weight"].T
    up = x @ w[pre + "up_proj.weight"].T
    return (F.silu(gate) * up) @ w[pre + "down_proj.weight"].T
