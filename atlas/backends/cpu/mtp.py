"""Reference MTP drafter forward (Qwen3-Next convention), stateless: the ground truth for issue 5's
incremental drafter.

Pair key k combines embed(t_{k+1}) with the target's final hidden state h_k, at RoPE position k + 1:
    x_k = fc([pre_fc_norm_embedding(embed(t_{k+1})), pre_fc_norm_hidden(h_k)])
then one (or more) full-attention decoder layers (gated attention, no indexer; causal over the pair keys
given), `mtp.norm`, and the shared lm_head. Row k's logits draft t_{k+2}.
"""

from __future__ import annotations

import torch

from atlas.backends.cpu.attention import attention_forward
from atlas.backends.cpu.moe import moe_block
from atlas.backends.cpu.state import KvPool
from atlas.backends.ops import dense_mlp, rms_norm, rope_table
from atlas.model.spec import ModelSpec

_BLOCK = 16


def mtp_forward(
    spec: ModelSpec, w: dict[str, torch.Tensor], hidden: torch.Tensor, next_tokens: torch.Tensor, first_key: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [n, H] (target hidden at positions first_key..), next_tokens [n] (the token after each):
    (draft logits [n, vocab], the drafter's own hidden states [n, H], for chaining later drafts)."""
    if "mtp.fc.weight" not in w:
        raise ValueError("this model has no MTP drafter weights (mtp.*)")
    n, eps = hidden.shape[0], spec.rms_norm_eps
    emb = rms_norm(w["embed_tokens.weight"][next_tokens], w["mtp.pre_fc_norm_embedding.weight"], eps)
    x = torch.cat([emb, rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1) @ w["mtp.fc.weight"].T

    # pair key k sits at RoPE position k + 1; in the scratch KV pool the given rows are stored from slot 0,
    # so causal masking runs over exactly these rows
    cos, sin = rope_table(torch.arange(first_key + 1, first_key + 1 + n), spec.rotary_dim, spec.rope_theta, x.dtype)
    layers = sorted({int(k.split(".")[2]) for k in w if k.startswith("mtp.layers.")})
    blocks = -(-n // _BLOCK)
    kv = KvPool(spec, blocks, _BLOCK, x.dtype, layers=tuple(layers))
    for layer in layers:
        pre = f"mtp.layers.{layer}."
        h = rms_norm(x, w[pre + "input_layernorm.weight"], eps)
        attn, _ = attention_forward(spec, w, pre + "self_attn.", layer, h, cos, sin, kv, tuple(range(blocks)), 0, None)
        x = x + attn
        h = rms_norm(x, w[pre + "post_attention_layernorm.weight"], eps)
        x = x + (moe_block(spec.moe, w, pre + "mlp.", h) if spec.moe is not None else dense_mlp(w, pre + "mlp.", h))
    out = rms_norm(x, w["mtp.norm.weight"], eps)
    return out @ w["lm_head.weight"].T, out
