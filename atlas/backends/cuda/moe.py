"""The routed experts of a MoE layer without a host sync: the Triton grouped kernels, or torch._grouped_mm.

Both sort the (row, slot) pairs by expert on the device (atlas_kernels.moe_grouped.moe_route) and read each
chosen expert's weights in place; neither copies the chosen experts' weights (the torch graph-safe path
gathers gate_up[top_i], ~25 MB a layer at batch 1) or runs every expert on every row (the "dense" path,
top_k / num_experts of its FLOPs useful), and neither syncs with the host (the "grouped" path's bincount
.tolist(): one sync a layer in prefill). Each pair's output row is written once and summed over the slots in
a fixed order.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def routed_triton(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """sum_k top_w * expert(x) [R, H] through atlas_kernels.moe_grouped (two kernels + routing + the sum)."""
    from atlas_kernels.moe_grouped import moe_grouped

    return moe_grouped(x, top_i, top_w, gate_up, down)


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here for `dtype` (torch >= 2.8; on CUDA bf16 on sm_90+): a tiny
    feature test against a plain product, once per (device, dtype)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(24, 32, generator=gen).to(device_type, dtype)
        b = torch.randn(2, 16, 32, generator=gen).to(device_type, dtype)
        got = torch._grouped_mm(a, b.transpose(1, 2), offs=torch.tensor([8, 24], dtype=torch.int32,
                                                                        device=device_type))
        want = torch.cat([a[:8] @ b[0].T, a[8:] @ b[1].T])
        return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def routed_grouped_mm(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor) -> torch.Tensor:
    """The same through torch._grouped_mm over the expert-sorted rows (cuBLAS / CUTLASS grouped GEMMs):
    gather rows, two grouped GEMMs with SwiGLU between, scatter back, weighted sum (~8 kernels a layer)."""
    from atlas_kernels.moe_grouped import moe_route

    rows, top_k = top_i.shape
    order, offsets = moe_route(top_i, gate_up.shape[0])
    ends = offsets[1:]
    gu = torch._grouped_mm(x[order // top_k], gate_up.transpose(1, 2), offs=ends)  # [R*K, 2I] expert-sorted
    g, u = gu.chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(g) * u, down.transpose(1, 2), offs=ends)  # [R*K, H]
    outs = torch.empty_like(out).index_copy_(0, order.long(), out)  # back to pair order r*K + k
    return (outs.view(rows, top_k, -1) * top_w[..., None]).sum(dim=1)
