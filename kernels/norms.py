"""Fused RMSNorms: the zero-centred one, x * rsqrt(mean(x^2) + eps) * (1 + w), used everywhere but inside
GDN, and GDN's gated output norm, x * rsqrt(mean(x^2) + eps) * w * silu(z). One pass over the row each:
read x (and z) once, write once, fp32 inside."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from atlas_kernels import _interpreter_compat  # noqa: F401  (CPU interpreter fix)


@triton.jit
def _rms_norm_kernel(
    x_ptr, gate_ptr, weight_ptr, out_ptr, num_rows, width, eps,
    BN: tl.constexpr, BM: tl.constexpr, GATED: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    mask = (rows < num_rows)[:, None] & (cols < width)[None, :]
    offsets = rows.to(tl.int64)[:, None] * width + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
    out = x * tl.rsqrt(tl.sum(x * x, 1) / width + eps)[:, None]
    if GATED:
        gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        out = out * weight[None, :] * gate * tl.sigmoid(gate)
    else:
        out = out * (1.0 + weight[None, :])
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"norm weight must be [{width}], got {tuple(weight.shape)}")
    rows = x.contiguous().view(-1, width)
    gate_rows = gate.contiguous().view(-1, width) if gate is not None else rows
    out = torch.empty_like(rows)
    block_n = triton.next_power_of_2(width)
    # several short rows per program (head-dim norms), one long row per program (hidden-size norms)
    block_m = max(1, min(16, 4096 // block_n))
    grid = (triton.cdiv(rows.shape[0], block_m),)
    _rms_norm_kernel[grid](rows, gate_rows, weight, out, rows.shape[0], width, eps,
                           BN=block_n, BM=block_m, GATED=gate is not None)
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim of x, in x's dtype."""
    return _launch(x, None, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN's gated RMSNorm over the last dim of x, in x's dtype."""
    if gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must match x {tuple(x.shape)}")
    return _launch(x, gate, weight, eps)
