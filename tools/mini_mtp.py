"""The MTP drafter head for training, in Atlas's `mtp.*` convention (atlas/backends/cpu/mtp.py is the reference
it must match; tests/test_train_patches.py checks it does).

transformers' Qwen4ExpForCausalLM has no MTP module (it ignores `mtp.*` on load), so this is written here from
transformers' own building blocks (zero-centred RMSNorm, the sparse MoE block) plus a gated attention without
the QSA indexer. Pair key k combines embed(t_{k+1}) with the trunk's final hidden h_k, at RoPE position k + 1:
    x_k = fc([pre_fc_norm_embedding(embed(t_{k+1})), pre_fc_norm_hidden(h_k)])
then decoder layers (causal over the pair keys), `norm`, and the shared lm_head: row k drafts t_{k+2}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rope(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, rotary_dim] in fp32, exactly as atlas.backends.cpu.rope.rope_table builds them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device)
                                .float() / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, n, d]; rotate the first rotary_dim features (rotate-half convention)."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos.to(x.dtype) + rotated * sin.to(x.dtype), rest], dim=-1)


class MtpAttention(nn.Module):
    """Gated attention (q_proj yields a query and an output gate per head), q/k norms, no indexer."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.num_heads * hd * 2, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = Qwen4ExpTextRMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = Qwen4ExpTextRMSNorm(hd, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, gate = self.q_proj(x).view(b, n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim)
        return self.o_proj(out * torch.sigmoid(gate.reshape(b, n, -1)))


class MtpLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.qwen4_exp.modeling_qwen4_exp import (
            Qwen4ExpTextRMSNorm,
            Qwen4ExpTextSparseMoeBlock,
        )

        self.input_layernorm = Qwen4ExpTextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = MtpAttention(config)
        self.post_attention_layernorm = Qwen4ExpTextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen4ExpTextSparseMoeBlock(config)  # Atlas: MoE whenever the model has MoE

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class MtpHead(nn.Module):
    """state_dict keys, prefixed with `mtp.`, are exactly atlas.model.weights.mtp_shapes's names."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

        h = config.hidden_size
        self.rotary_dim = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
        self.rope_theta = float(config.rope_parameters["rope_theta"])
        self.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([MtpLayer(config) for _ in range(max(1, config.mtp_num_hidden_layers))])
        self.norm = Qwen4ExpTextRMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, embed: torch.Tensor, hidden: torch.Tensor, first_key: int = 0) -> torch.Tensor:
        """embed [B, n, H] = embed(t_{k+1}), hidden [B, n, H] = h_k for keys first_key..: the drafter's hidden
        states [B, n, H] (logits are lm_head of these)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embed), self.pre_fc_norm_hidden(hidden)], dim=-1))
        n = x.shape[1]
        positions = torch.arange(first_key + 1, first_key + 1 + n, device=x.device)
        cos, sin = _rope(positions, self.rotary_dim, self.rope_theta)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


def init_mtp(head: MtpHead, std: float) -> None:
    """transformers' conventions: normal(std) matrices and experts, zero (= identity) RMSNorm weights."""
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.zero_()
            else:
                p.normal_(0.0, std)


def build_models(config: dict, device: torch.device) -> tuple[nn.Module, MtpHead]:
    """(Qwen4ExpForCausalLM from transformers, MtpHead), initialised, on `device`, fp32."""
    import transformers as tf

    hf_config = tf.Qwen4ExpTextConfig(**config)
    model = tf.Qwen4ExpForCausalLM(hf_config)
    head = MtpHead(hf_config)
    init_mtp(head, hf_config.initializer_range)
    return model.to(device), head.to(device)


def mtp_pairs(embed_weight: torch.Tensor, hidden: torch.Tensor, input_ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The training pairs of a batch: (embed(t_{k+1}), h_k) for k = 0 .. T-2, each [B, T-1, H]."""
    return F.embedding(input_ids[:, 1:], embed_weight), hidden[:, :-1]


def mtp_loss(draft_logits: torch.Tensor, trunk_logits: torch.Tensor, input_ids: torch.Tensor,
             soft_weight: float) -> torch.Tensor:
    """Row k (k = 0 .. T-3) drafts t_{k+2}: cross-entropy on the text mixed with the trunk's own distribution at
    position k + 1 (what the verifier will compare against). draft_logits [B, T-1, V], trunk_logits [B, T, V]."""
    logits = draft_logits[:, :-1].float().flatten(0, 1)
    hard = F.cross_entropy(logits, input_ids[:, 2:].flatten())
    if soft_weight <= 0:
        return hard
    target = torch.softmax(trunk_logits[:, 1:-1].detach().float().flatten(0, 1), dim=-1)
    soft = -(target * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    return (1 - soft_weight) * hard + soft_weight * soft
