"""The sparse MoE block with a gated shared expert, and the dense SwiGLU MLP (atlas.backends.ops.dense_mlp's
arithmetic, with the row-exact products of atlas.backends.cpu.rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atlas.backends.cpu.rows import CHUNK, RowMath
from atlas.backends.cpu.weights import DENSE_IN, MOE_IN, joined
from atlas.backends.ops import acc_dtype
from atlas.model.spec import MoeSpec


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
