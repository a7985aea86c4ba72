"""Training the QSA indexer: its block scores learn where the attention it serves would look (training only).

The selection is a boolean mask, so the language-model loss gives the indexer no gradient (in transformers as
in Atlas): left alone it would select by its initial random projections forever. As DeepSeek's sparse
attention trains its "lightning indexer", this adds a distillation loss per QSA layer: the dense attention
distribution of the layer's own queries (all heads, causal, computed without gradient) summed per block, against
the softmax of the indexer's block scores over the complete blocks a query sees, KL(target || indexer), averaged
over the queries whose selection is sparse (more complete blocks than block_topk). The indexer's input is
detached, so the loss trains the indexer's weights only: the model's forward and its gradients are unchanged.
"""

from __future__ import annotations

import torch
from train_patches import _ORIGINALS, visible_blocks

_LOSSES: list[torch.Tensor] = []


@torch.no_grad()
def block_attention(attn, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ratio: int
                    ) -> torch.Tensor:
    """The layer's dense causal attention, averaged over heads and summed per complete block: [B, T, blocks]."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb, repeat_kv

    batch, seq, _ = hidden_states.shape
    shape = (batch, seq, -1, attn.head_dim)
    q, _ = attn.q_proj(hidden_states).view(batch, seq, -1, 2 * attn.head_dim).chunk(2, dim=-1)
    q = attn.q_norm(q.reshape(shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(hidden_states).view(shape)).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos[:, -seq:], sin[:, -seq:])
    logits = (q.float() @ repeat_kv(k, attn.num_key_value_groups).float().transpose(-1, -2)) * attn.scaling
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    probs = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1).mean(dim=1)  # [B, T, T]
    blocks = seq // ratio
    return probs[..., : blocks * ratio].reshape(batch, seq, blocks, ratio).sum(-1)


def distillation_loss(scores: torch.Tensor, target: torch.Tensor, ratio: int, block_topk: int) -> torch.Tensor:
    """KL(target || softmax(scores)) over each query's visible complete blocks, mean over the sparse queries:
    t >= (block_topk + 1) * ratio - 1, a slice (a boolean index would sync the host). Only those rows reach the
    log-softmax: a query with no complete block would make a NaN row whose backward poisons the scores."""
    seq = scores.shape[1]
    first = (block_topk + 1) * ratio - 1
    if seq <= first:
        return scores.sum() * 0.0
    visible = visible_blocks(seq, ratio, scores.device)[first:]  # [T', blocks], at least block_topk + 1 each
    log_q = scores[:, first:].float().masked_fill(~visible, float("-inf")).log_softmax(dim=-1)
    p = target[:, first:].masked_fill(~visible, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    # masked entries have p = 0; the clamp keeps 0 * -inf out of the sum (and passes no gradient there)
    kl = (p * (p.clamp_min(1e-12).log() - log_q.clamp_min(-1e4))).sum(-1)
    return kl.mean()


def attention_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask: torch.Tensor,
                      cache=None, **kwargs):
    """Qwen4ExpTextAttention.forward, unchanged, plus this layer's indexer loss (kept for `collect`)."""
    training = cache is None and torch.is_grad_enabled()
    self.indexer.train_scores = training
    out = _ORIGINALS["attention"](self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
    if training and getattr(self.indexer, "kept_scores", None) is not None:
        scores, self.indexer.kept_scores = self.indexer.kept_scores, None
        cos, sin = position_embeddings
        target = block_attention(self, hidden_states.detach(), cos, sin, self.indexer.compress_ratio)
        _LOSSES.append(distillation_loss(scores, target, self.indexer.compress_ratio, self.indexer.block_topk))
    return out


def collect(device: torch.device) -> torch.Tensor:
    """The mean indexer loss over the QSA layers of the last forward (0 when there was none); clears it."""
    if not _LOSSES:
        return torch.zeros((), device=device)
    loss = torch.stack(_LOSSES).mean()
    _LOSSES.clear()
    return loss


def apply() -> str:
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    _ORIGINALS.setdefault("attention", hf.Qwen4ExpTextAttention.forward)
    hf.Qwen4ExpTextAttention.forward = attention_forward
    return "qsa indexer: trained by distillation from its layer's dense attention (indexer_loss.py)"


def restore() -> None:
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    if "attention" in _ORIGINALS:
        hf.Qwen4ExpTextAttention.forward = _ORIGINALS["attention"]
    _LOSSES.clear()
