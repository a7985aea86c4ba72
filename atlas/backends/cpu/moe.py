"""The sparse MoE block with a gated shared expert (the dense SwiGLU MLP is atlas.backends.ops.dense_mlp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atlas.backends.ops import acc_dtype, dense_mlp
from atlas.model.spec import MoeSpec


def moe_block(moe: MoeSpec, w: dict[str, torch.Tensor], pre: str, x: torch.Tensor) -> torch.Tensor:
    """x [n, H] -> [n, H]: top-k routed experts (softmax, then top-k, renormalised) + sigmoid-gated shared."""
    logits = x @ w[pre + "gate.weight"].T
    probs = torch.softmax(logits.to(acc_dtype(x.dtype)), dim=-1)
    top_w, top_i = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    top_w = top_w.to(x.dtype)

    gate_up, down = w[pre + "experts.gate_up_proj"], w[pre + "experts.down_proj"]
    routed = torch.zeros_like(x)
    # experts in ascending order, as the reference sums them
    for expert in torch.unique(top_i).tolist():
        tokens, slots = torch.where(top_i == expert)
        gate, up = (x[tokens] @ gate_up[expert].T).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ down[expert].T
        routed.index_add_(0, tokens, out * top_w[tokens, slots, None])

    shared = dense_mlp(w, pre + "shared_expert.", x)
    return routed + torch.sigmoid(x @ w[pre + "shared_expert_gate.weight"].T) * shared
