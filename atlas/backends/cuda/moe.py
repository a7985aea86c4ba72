"""The routed experts of a MoE layer without a host sync: the Triton grouped kernels.

They sort the (row, slot) pairs by expert on the device (atlas_kernels.moe_grouped.moe_route) and read each
chosen expert's weights in place; they neither copy the chosen experts' weights (the torch graph-safe path
gathers gate_up[top_i], ~25 MB a layer at batch 1), run every expert on every row (the torch path at many rows,
top_k / num_experts of its FLOPs useful), nor sync with the host (the "grouped" path's bincount
.tolist(): one sync a layer in prefill). Each pair's output row is written once and summed over the slots in
a fixed order.
"""

from __future__ import annotations

import torch


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
    is j, summed out of a [R, E, k] comparison (session 15; before, a scatter of the experts by rank, which Inductor
    left to ATen's scatter kernel: one launch a MoE layer of its own, 24 a decode step)."""
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
    transpose, summed: session 15, before a scatter left to ATen's kernel, a launch a MoE layer), and an expert's
    offset the count of pairs routed to a lower expert: comparisons and sums only. Otherwise a one-hot and its running sums over the pairs: Inductor's
    scan along the pairs was one 26.5 us kernel a layer at batch 64 (256 pairs) on the H200 (session 8), 0.64 ms
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
