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


def block_scores(indexer, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Every query's score for every complete block of the sequence, [B, T, blocks] fp32 (differentiable):
    sum_h relu(q_h . k_block) / sqrt(d), k_block the mean of the block's raw keys, normed, roped at its start."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    batch, seq, _ = hidden_states.shape
    ratio, d, heads = indexer.compress_ratio, indexer.index_head_dim, indexer.index_n_heads
    q, raw = indexer.index_qk_proj(hidden_states).split([heads * d, indexer.index_kv_heads * d], dim=-1)
    q = indexer.q_layernorm(q.reshape(batch, seq, heads, d))
    q = apply_rotary_pos_emb(q, cos=cos[:, -seq:], sin=sin[:, -seq:], unsqueeze_dim=2)
    blocks = seq // ratio
    pooled = raw[:, : blocks * ratio].reshape(batch, blocks, ratio, d).float().mean(dim=2).to(raw.dtype)
    pooled = indexer.k_layernorm(pooled)
    starts = torch.arange(blocks, device=hidden_states.device) * ratio
    keys = apply_rotary_pos_emb(pooled.unsqueeze(2), cos=cos[:, starts], sin=sin[:, starts],
                                unsqueeze_dim=2).squeeze(2)  # [B, blocks, d]
    return torch.einsum("bthd,bnd->btnh", q.float(), keys.float()).relu().sum(-1) / math.sqrt(d)


def visible_blocks(seq: int, ratio: int, device: torch.device) -> torch.Tensor:
    """[T, blocks] bool: the complete blocks query t sees (those ending at or before t)."""
    complete = (torch.arange(seq, device=device) + 1) // ratio
    return torch.arange(seq // ratio, device=device)[None, :] < complete[:, None]


@torch.no_grad()
def selection_mask(scores: torch.Tensor, ratio: int, block_topk: int) -> torch.Tensor:
    """Block scores [B, T, blocks] -> the [B, 1, T, T] bool mask of tokens each query attends."""
    batch, seq, blocks = scores.shape
    device = scores.device
    positions = torch.arange(seq, device=device)
    complete = (positions + 1) // ratio
    scores = scores.masked_fill(~visible_blocks(seq, ratio, device), float("-inf"))
    top = scores.topk(min(block_topk, blocks), dim=-1)
    # a query with fewer complete blocks than block_topk keeps all of them: the -inf picks are dropped
    picked = torch.where(top.values > float("-inf"), top.indices, blocks)
    chosen = torch.zeros(batch, seq, blocks + 1, dtype=torch.bool, device=device).scatter_(-1, picked, True)
    block_of = (positions // ratio).clamp_max(blocks)  # tokens past the last whole block map to the pad column
    selected = chosen[:, :, block_of]  # [B, T, T]: token j of a chosen block
    tail = positions[None, :] >= (complete * ratio)[:, None]  # the query's incomplete block
    causal = positions[None, :] <= positions[:, None]
    return ((selected | tail) & causal).unsqueeze(1)


def fast_indexer_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor,
                         cache=None, **kwargs) -> torch.Tensor:
    """Qwen4ExpTextQSAIndexer.forward for a cache-free causal batch: [B, 1, T, T] bool selection mask. With the
    indexer loss on (tools/indexer_loss.py) and gradients enabled, the scores are also kept, differentiable in
    the indexer's weights only (its input is detached), for that loss."""
    batch, seq, _ = hidden_states.shape
    if cache is not None or attention_mask.shape[-1] != seq or attention_mask.shape[-2] != seq:
        return _ORIGINALS["indexer"](self, hidden_states, position_embeddings, attention_mask, cache)
    if seq < self.compress_ratio:
        causal = torch.ones(seq, seq, dtype=torch.bool, device=hidden_states.device).tril()
        return causal.expand(batch, 1, seq, seq)
    cos, sin = position_embeddings  # [B, T, rotary_dim], positions 0..T-1
    if getattr(self, "train_scores", False) and torch.is_grad_enabled():
        scores = block_scores(self, hidden_states.detach(), cos, sin)
        self.kept_scores = scores
        return selection_mask(scores.detach(), self.compress_ratio, self.block_topk)
    with torch.no_grad():
        return selection_mask(block_scores(self, hidden_states, cos, sin), self.compress_ratio, self.block_topk)


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
    if "attention" in _ORIGINALS:  # tools/indexer_loss.py's
        hf.Qwen4ExpTextAttention.forward = _ORIGINALS["attention"]
