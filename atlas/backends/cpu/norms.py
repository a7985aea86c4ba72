"""Normalisations. Computed in at least fp32 (as transformers does), then cast back to the input dtype."""

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
