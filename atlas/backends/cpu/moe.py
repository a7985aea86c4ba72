"""The sparse MoE block with a gated shared expert, and the dense SwiGLU MLP (atlas.backends.ops.dense_mlp's
arithmetic, with the row-exact products of atlas.backends.cpu.rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atlas.backends.cpu.rows import CHUNK, RowMath
from atlas.backends.cpu.weights import DENSE_IN, MOE_IN, joined
from atlas.backends.ops import acc_dtype
from atlas.model.spec import MoeSpec

DENSE_EXPERTS = 16  # a model with at most this many experts runs every expert on every row (_every_expert)


def dense_mlp(w: dict[str, torch.Tensor], pre: str, x: torch.Tensor, rows: RowMath = CHUNK) -> torch.Tensor:
    proj, sizes = joined(w, pre, DENSE_IN)
    gate, up = rows.mm(x, proj).split(sizes, dim=-1)
    return _swiglu(w, pre, gate, up, rows)


def _swiglu(w: dict[str, torch.Tensor], pre: str, gate: torch.Tensor, up: torch.Tensor, rows: RowMath
            ) -> torch.Tensor:
    return rows.mm(rows.each(F.silu, gate) * up, w[pre + "down_proj.weight"])


def moe_block(moe: MoeSpec, w: dict[str, torch.Tensor], pre: str, x: torch.Tensor, rows: RowMath = CHUNK
              ) -> torch.Tensor:
    """x [n, H] -> [n, H]: top-k routed experts (softmax, then top-k, renormalised) + sigmoid-gated shared."""
    proj, sizes = joined(w, pre, MOE_IN)  # router, shared expert gate/up and its gate: one product
    logits, shared_gate, shared_up, gate_logit = rows.mm(x, proj).split(sizes, dim=-1)
    probs = torch.softmax(logits.to(acc_dtype(x.dtype)), dim=-1)  # each row's bits its own at any row count
    top_w, top_i = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    top_w = top_w.to(x.dtype)

    gate_up, down = w[pre + "experts.gate_up_proj"], w[pre + "experts.down_proj"]
    if gate_up.shape[0] <= DENSE_EXPERTS and (rows.exact or x.shape[0] == 1):
        routed = _every_expert(gate_up, down, x, top_w, top_i)
    else:
        routed = torch.zeros_like(x)
        # experts in ascending order, as the reference sums them
        for expert in torch.unique(top_i).tolist():
            tokens, slots = torch.where(top_i == expert)
            gate, up = rows.mm(x[tokens], gate_up[expert]).chunk(2, dim=-1)
            out = rows.mm(rows.each(F.silu, gate) * up, down[expert])
            routed.index_add_(0, tokens, out * top_w[tokens, slots, None])

    shared = _swiglu(w, pre + "shared_expert.", shared_gate, shared_up, rows)
    gate = rows.each(torch.sigmoid, gate_logit)
    return routed + gate * shared


def _every_expert(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, top_w: torch.Tensor,
                  top_i: torch.Tensor) -> torch.Tensor:
    """The routed experts' sum for rows x [n, H], with the bits of the per-expert loop: every expert on each row
    as one-row products batched over the experts (torch.bmm over the expert weights, bitwise the loop's products
    of one row or several), then each row's chosen experts weighted and added from zero in ascending expert order.
    Two batched products a row in place of a few dozen calls an expert: on a model of a few experts (atlas-mini
    has 4, 2 of them chosen) the experts no row chose cost less than the calls they save."""
    n, experts = x.shape[0], gate_up.shape[0]
    up_t, down_t = gate_up.transpose(1, 2), down.transpose(1, 2)  # [E, H, 2I], [E, I, H]
    outs = []
    for row in x:
        gate, up = torch.bmm(row.expand(experts, 1, -1), up_t).chunk(2, dim=-1)
        outs.append(torch.bmm(F.silu(gate) * up, down_t))  # [E, 1, H]
    out = torch.cat(outs, dim=1) if n > 1 else outs[0]  # [E, n, H]
    top_i, order = top_i.sort(dim=-1)
    weighted = out[top_i, torch.arange(n)[:, None]] * top_w.gather(-1, order)[..., None]  # [n, k, H]
    routed = torch.zeros_like(x)
    for slot in range(top_i.shape[1]):
        routed = routed + weighted[:, slot]
    return routed
