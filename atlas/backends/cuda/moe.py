"""A MoE layer over rows on the CUDA backend: the router and the shared expert (moe_router), the routed experts
(moe_routed) in the mode the tuning picks (moe_mode_of), and the routes the compiled regions count on the device.

The routed experts without a host sync: the Triton grouped kernels.

They sort the (row, slot) pairs by expert on the device (atlas_kernels.moe_grouped.moe_route) and read each
chosen expert's weights in place; they neither copy the chosen experts' weights (the torch graph-safe path
gathers gate_up[top_i], ~25 MB a layer at batch 1), run every expert on every row (the torch path at many rows,
top_k / num_experts of its FLOPs useful), nor sync with the host (the "grouped" path's bincount
.tolist(): one sync a layer in prefill). Each pair's output row is written once and summed over the slots in
a fixed order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atlas.backends.cuda.primitives import linear, split_out
from atlas.backends.cuda.tuning import Tuning
from atlas.backends.ops import acc_dtype
from atlas.model.spec import MoeSpec


def routed_triton(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, route: tuple[torch.Tensor, torch.Tensor] | None = None,
                  summed: bool = True) -> torch.Tensor:
    """sum_k top_w * expert(x) [R, H] through atlas_kernels.moe_grouped (two kernels + routing + the sum);
    `route`: the (order, offsets) of the pairs if the caller computed them (counted_route); summed=False: the
    pairs' weighted outputs [R, K, H], the sum left to the caller (regions.settle)."""
    from atlas_kernels.moe_grouped import moe_grouped

    return moe_grouped(x, top_i, top_w, gate_up, down, route=route, summed=summed)


# ranked_topk / counted_route: for at most this many experts (their [R, E, E] / [R * K, E] temporaries)
SMALL_EXPERTS = 64


def ranked_topk(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(probs [R, E], k) (descending; equal values in index order, as a stable sort) written as
    comparisons and sums, which Inductor fuses into the router's kernels: torch.topk is two generic kernels, 8.5 us a
    layer at batch 1 on the H200 (0.2 ms of a 4.5 ms decode step). For E <= 64. The j-th expert is the one whose rank
    is j, summed out of a [R, E, k] comparison (a scatter of the experts by rank would go to ATen's scatter kernel,
    Inductor cannot fuse it: one launch a MoE layer of its own, 24 a decode step)."""
    e = probs.shape[1]
    idx = torch.arange(e, device=probs.device)
    mine, other = probs[:, :, None], probs[:, None, :]
    # rank of expert i: how many experts come before it (greater, or equal at a lower index)
    ahead = (other > mine) | ((other == mine) & (idx[None, None, :] < idx[None, :, None]))
    rank = ahead.sum(dim=-1)  # [R, E], a permutation of 0..E-1 in each row
    slots = torch.arange(k, device=probs.device)
    top_i = ((rank[:, :, None] == slots[None, None, :]) * idx[None, :, None]).sum(dim=1)  # [R, k]
    return probs.gather(1, top_i), top_i


# counted_route's pair-by-pair ranks: for at most this many (row, slot) pairs (a [P, P] comparison a route)
RANKED_PAIRS = 1024


def counted_route(top_i: torch.Tensor, num_experts: int, ranked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """atlas_kernels.moe_grouped.moe_route (the pairs r*K + k in a stable order by expert, and each expert's
    offsets [E + 1] int32) by counting instead of sorting, fusable (the sort and searchsorted are three kernels,
    ~12 us a layer at batch 1 on the H200).

    ranked (decode groups, at most RANKED_PAIRS pairs): each pair's place is its rank among the pairs by
    (expert, pair index), one [P, P] comparison summed, the order the pair whose place is q (the same comparison's
    transpose, summed: a scatter would be left to ATen's kernel, a launch a MoE layer), and an expert's
    offset the count of pairs routed to a lower expert: comparisons and sums only. Otherwise a one-hot and its running sums over the pairs: Inductor's
    scan along the pairs was one 26.5 us kernel a layer at batch 64 (256 pairs) on the H200, 0.64 ms
    of a 6.5 ms step. Both give the same order and offsets (tests/test_cuda_regions.py)."""
    flat = top_i.flatten()
    pairs = flat.shape[0]
    if ranked:
        idx = torch.arange(pairs, device=flat.device)
        mine, other = flat[:, None], flat[None, :]
        # pairs before pair p in the stable sort: a lower expert, or the same expert at a lower pair index
        place = ((other < mine) | ((other == mine) & (idx[None, :] < idx[:, None]))).sum(dim=1)
        lower = flat[None, :] < torch.arange(num_experts + 1, device=flat.device)[:, None]
        offsets = lower.sum(dim=1).to(torch.int32)
        order = ((place[None, :] == idx[:, None]) * idx[None, :]).sum(dim=1)  # order[q]: the pair placed at q
        return order, offsets
    onehot = (flat[:, None] == torch.arange(num_experts, device=flat.device)).to(torch.int32)
    before = (torch.cumsum(onehot, dim=0) - onehot).gather(1, flat[:, None])[:, 0]  # same expert, earlier pairs
    offsets = torch.cat([onehot.new_zeros(1), torch.cumsum(onehot.sum(dim=0), dim=0)]).to(torch.int32)
    order = torch.empty_like(flat).scatter_(0, offsets[flat].to(flat.dtype) + before,
                                            torch.arange(pairs, device=flat.device))
    return order, offsets

def moe_mode_of(tuning: Tuning, prefill: bool) -> str:
    """moe_routed's mode for a group (Tuning.moe_kernels): "triton" the device-routed kernels;
    else a prefill chunk's "grouped" (one host sync a layer) and a decode group's "torch" (fixed shapes)."""
    if not tuning.moe_kernels:
        return "grouped" if prefill else "torch"
    return "triton"


def moe_router(moe: MoeSpec, x: torch.Tensor, fused_in: torch.Tensor, shared_down: torch.Tensor,
               ranked: bool = False, gemv: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing and the shared expert on tensors: (top_w [R, K] in x's dtype, top_i [R, K], the gated
    shared expert's output [R, H]). ranked: the top-k as moe.ranked_topk (fusable; torch.topk's result); gemv:
    the two products' form (`linear`)."""
    shared_width = moe.shared_intermediate_size
    logits, shared_gate, shared_up, shared_scale = split_out(
        linear(x, fused_in, gemv), [moe.num_experts, shared_width, shared_width, 1])
    probs = torch.softmax(logits.to(acc_dtype(x.dtype)), dim=-1)
    top_w, top_i = ranked_topk(probs, moe.top_k) if ranked else torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    shared = linear(F.silu(shared_gate) * shared_up, shared_down, gemv)
    return top_w.to(x.dtype), top_i, torch.sigmoid(shared_scale) * shared


def moe_layer(moe: MoeSpec, w: dict[str, torch.Tensor], pre: str, x: torch.Tensor, *, eager: bool = False,
              mode: str | None = None) -> torch.Tensor:
    """x [R, H] -> [R, H]: top-k routed experts (moe_routed) + sigmoid-gated shared expert."""
    top_w, top_i, shared = moe_router(moe, x, w[pre + "fused_in.weight"], w[pre + "shared_expert.down_proj.weight"])
    return moe_routed(moe, w, pre, x, top_w, top_i, eager=eager, mode=mode) + shared


def moe_routed(moe: MoeSpec, w: dict[str, torch.Tensor], pre: str, x: torch.Tensor, top_w: torch.Tensor,
               top_i: torch.Tensor, *, eager: bool = False, mode: str | None = None,
               route: tuple[torch.Tensor, torch.Tensor] | None = None, summed: bool = True) -> torch.Tensor:
    """sum_k top_w * expert_{top_i}(x) [R, H] (summed=False with mode "triton": the pairs' weighted outputs
    [R, K, H], each the row's own slot k, the sum over k the caller's; every other mode sums here).

    eager: group tokens by expert (one host sync for the counts; right for prefill, where each expert
    sees many tokens). Otherwise fixed shapes for CUDA graphs: with fewer routed slots than experts, the
    chosen experts' weights are gathered per slot; else every expert runs on every row, weighted by a
    routing matrix that is zero off the top-k (decode at batch >= E / top_k touches most experts anyway).
    mode (moe_mode_of) overrides eager: "grouped" is eager; "torch" the fixed shapes; "triton" routes on the
    device and reads the chosen experts in place (atlas.backends.cuda.moe: no host sync, graph-capturable). route: the pairs' (order,
    offsets) for "triton" if the caller counted them (moe.counted_route)."""
    eager = mode == "grouped" if mode is not None else eager
    rows = x.shape[0]
    gate_up, down = w[pre + "experts.gate_up_proj"], w[pre + "experts.down_proj"]
    if mode == "triton":
        return routed_triton(x, top_i, top_w, gate_up, down, route, summed)
    if eager:
        # (token, slot) pairs sorted by expert: one host sync for the counts, each pair's output written once
        # (no atomics), then summed over the slots in a fixed order
        pairs = top_i.flatten()
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=moe.num_experts).tolist()
        outs = torch.empty(rows * moe.top_k, x.shape[-1], dtype=x.dtype, device=x.device)
        for expert, picked in enumerate(torch.split(order, counts)):
            if not counts[expert]:
                continue
            g, u = (x[picked // moe.top_k] @ gate_up[expert].T).chunk(2, dim=-1)
            outs[picked] = (F.silu(g) * u) @ down[expert].T
        return (outs.view(rows, moe.top_k, -1) * top_w[..., None]).sum(dim=1)
    if rows * moe.top_k < moe.num_experts:
        gu = torch.einsum("rh,rkih->rki", x, gate_up[top_i])
        g, u = gu.chunk(2, dim=-1)
        out = torch.einsum("rki,rkhi->rkh", F.silu(g) * u, down[top_i])
        return (out * top_w[..., None]).sum(dim=1)
    gu = torch.einsum("rh,eih->eri", x, gate_up)
    g, u = gu.chunk(2, dim=-1)
    out = torch.bmm(F.silu(g) * u, down.transpose(1, 2))  # [E, R, H]
    weights = torch.zeros(rows, moe.num_experts, dtype=x.dtype, device=x.device).scatter_(1, top_i, top_w)
    return torch.einsum("re,erh->rh", weights, out)
