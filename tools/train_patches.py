"""Training-speed replacements patched into transformers' qwen4_exp module (training only; Atlas never imports
this). Each computes what the module's own code computes, vectorised; tests/test_train_patches.py checks them
against the originals.

- GDN: `torch_chunk_gated_delta_rule` -> tools/fast_gdn.py (fp32 math under autocast, one batched solve).
- QSA indexer: transformers' `Qwen4ExpTextQSAIndexer.forward` loops in Python over every (sequence, query) pair,
  ~15 small ops each: at batch 32 x 512 that is 16,384 iterations per attention layer per step, which is where
  the issue's 606 tokens/s (27 s a step) on the H200 goes. Here one pass scores every query against every
  complete block at once, masks blocks a query cannot see yet, and takes top-k for all queries together. Only
  the case training uses is vectorised (no cache, every query sees positions 0..t: no padding); anything
  else falls back to the original. The selection is a boolean mask, so no gradient flows through it in
  either version (the indexer's weights stay at their initialisation, as with transformers' own training).
- MoE experts: the eager path loops over the experts that were hit, and finding them (`nonzero`) syncs the
  host with the device once per layer. Dense here: every expert on every token, weighted by the router's top-k
  weights scattered into [tokens, experts] (zero elsewhere), as two large matmuls with no host sync. The
  result and the gradients are the eager ones; the FLOPs are experts/top_k times the sparse ones, which a
  model this small does not notice on a GPU.
"""

from __future__ import annotations

import math

import torch

_ORIGINALS: dict[str, object] = {}


def fast_indexer_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor,
                         cache=None, **kwargs) -> torch.Tensor:
    """Qwen4ExpTextQSAIndexer.forward for a cache-free causal batch: [B, 1, T, T] bool selection mask."""
    batch, seq, _ = hidden_states.shape
    if cache is not None or attention_mask.shape[-1] != seq or attention_mask.shape[-2] != seq:
        return _ORIGINALS["indexer"](self, hidden_states, position_embeddings, attention_mask, cache)
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    ratio, d, heads = self.compress_ratio, self.index_head_dim, self.index_n_heads
    device = hidden_states.device
    with torch.no_grad():
        cos, sin = position_embeddings  # [B, T, rotary_dim], positions 0..T-1
        q, raw = self.index_qk_proj(hidden_states).split([heads * d, self.index_kv_heads * d], dim=-1)
        q = self.q_layernorm(q.reshape(batch, seq, heads, d))
        q = apply_rotary_pos_emb(q, cos=cos[:, -seq:], sin=sin[:, -seq:], unsqueeze_dim=2)
        blocks = seq // ratio
        positions = torch.arange(seq, device=device)
        causal = positions[None, :] <= positions[:, None]
        if blocks == 0:
            return causal.expand(batch, 1, seq, seq)
        pooled = raw[:, : blocks * ratio].reshape(batch, blocks, ratio, d).float().mean(dim=2).to(raw.dtype)
        pooled = self.k_layernorm(pooled)
        starts = torch.arange(blocks, device=device) * ratio
        keys = apply_rotary_pos_emb(pooled.unsqueeze(2), cos=cos[:, starts], sin=sin[:, starts],
                                    unsqueeze_dim=2).squeeze(2)  # [B, blocks, d]
        scores = torch.einsum("bthd,bnd->btnh", q.float(), keys.float()).relu_().sum(-1) / math.sqrt(d)
        complete = (positions + 1) // ratio  # complete blocks each query sees
        visible = torch.arange(blocks, device=device)[None, :] < complete[:, None]  # [T, blocks]
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.block_topk, blocks), dim=-1)
        # a query with fewer complete blocks than block_topk keeps all of them: the -inf picks are dropped
        picked = torch.where(top.values > float("-inf"), top.indices, blocks)
        chosen = torch.zeros(batch, seq, blocks + 1, dtype=torch.bool, device=device).scatter_(-1, picked, True)
        block_of = (positions // ratio).clamp_max(blocks)  # tokens past the last whole block map to the pad column
        selected = chosen[:, :, block_of]  # [B, T, T]: token j of a chosen block
        tail = positions[None, :] >= (complete * ratio)[:, None]  # the query's incomplete block
        return ((selected | tail) & causal).unsqueeze(1)


def dense_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """Qwen4ExpTextExperts.forward with every expert on every token (weights zero off the top-k)."""
    tokens, hidden = hidden_states.shape
    experts, inter = self.num_experts, self.intermediate_dim
    weights = torch.zeros(tokens, experts, dtype=top_k_weights.dtype, device=hidden_states.device)
    weights = weights.scatter(1, top_k_index, top_k_weights)
    gate_up = hidden_states @ self.gate_up_proj.reshape(experts * 2 * inter, hidden).T  # [N, E * 2I]
    gate, up = gate_up.view(tokens, experts, 2 * inter).chunk(2, dim=-1)
    act = self.act_fn(gate) * up * weights[..., None].to(gate.dtype)  # [N, E, I]
    down = self.down_proj.transpose(1, 2).reshape(experts * inter, hidden)  # [E * I, H]
    return (act.reshape(tokens, experts * inter) @ down).to(hidden_states.dtype)


def router_balance_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func (Switch Transformer's, pooled over layers) without its histc
    (whose integer CUDA path this run would be first to try): E * sum_e f_e P_e, with f_e the share of top-k
    assignments and P_e the mean router probability, both over every token of every layer."""
    probs = torch.cat([torch.softmax(g.float(), dim=-1) for g in router_logits])  # [layers * N, E]
    chosen = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, dim=-1).indices, 1.0)
    return num_experts * (chosen.mean(0) * probs.mean(0)).sum()


def apply(gdn: bool = True, indexer: bool = True, experts: bool = True) -> list[str]:
    """Patch transformers' qwen4_exp module in place; returns what was patched (for the log and model card)."""
    from fast_gdn import chunk_gated_delta_rule
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    done = []
    if gdn:
        _ORIGINALS.setdefault("gdn", hf.torch_chunk_gated_delta_rule)
        hf.torch_chunk_gated_delta_rule = chunk_gated_delta_rule
        done.append("gdn: tools/fast_gdn.chunk_gated_delta_rule")
    if indexer:
        _ORIGINALS.setdefault("indexer", hf.Qwen4ExpTextQSAIndexer.forward)
        hf.Qwen4ExpTextQSAIndexer.forward = fast_indexer_forward
        done.append("qsa indexer: vectorised selection (train_patches.fast_indexer_forward)")
    if experts:
        _ORIGINALS.setdefault("experts", hf.Qwen4ExpTextExperts.forward)
        hf.Qwen4ExpTextExperts.forward = dense_experts_forward
        done.append("moe experts: dense, no host sync (train_patches.dense_experts_forward)")
    return done


def restore() -> None:
    """Undo `apply` (tests patch and unpatch within one process)."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    if "gdn" in _ORIGINALS:
        hf.torch_chunk_gated_delta_rule = _ORIGINALS["gdn"]
    if "indexer" in _ORIGINALS:
        hf.Qwen4ExpTextQSAIndexer.forward = _ORIGINALS["indexer"]
    if "experts" in _ORIGINALS:
        hf.Qwen4ExpTextExperts.forward = _ORIGINALS["experts"]
