"""The atlas-mini model configs: qwen4_exp text models with every feature Atlas serves.

GDN and QSA full-attention layers (ratio 4, budget 32: a prompt of more than budget + ratio - 1 = 35 tokens
is attended sparsely), PLE n-gram embeddings on two GDN layers, two hyper-connection streams, MoE on every
layer (with the shared expert Atlas requires), tied embeddings, and one MTP drafter layer (`mtp.*`, announced by
`mtp_num_hidden_layers`; transformers ignores those tensors).

`mini` is what the GPU run trains: sized so that model.safetensors in bf16 stays under the 12 MB the repo
allows (`python tools/mini_config.py` prints the counts). `tiny` is the CPU smoke test's: the same features,
small enough to train end to end in well under two minutes on two cores.
"""

from __future__ import annotations

import copy
import sys

# special tokens first, so their ids are the same for every vocabulary size
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = 0, 1, 2, 3

_COMMON: dict = {
    "architectures": ["Qwen4ExpForCausalLM"],
    "model_type": "qwen4_exp_text",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "hc_count": 2,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "make_ngram_vocab_size_divisible_by": 8,
    "split_ngram_parts": 4,
    "seed": 1234,
    "indexer_kv_heads": 1,
    "indexer_budget": 32,
    "indexer_compress_ratio": 4,
    "mtp_num_hidden_layers": 1,
    # PLE restarts its n-gram context at the first id; generation also stops at <|im_end|>
    "eos_token_id": [EOS_ID, IM_END_ID],
    "bos_token_id": None,
    "pad_token_id": PAD_ID,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "router_aux_loss_coef": 0.01,
    "initializer_range": 0.02,
}

PRESETS: dict[str, dict] = {
    "mini": {
        "vocab_size": 4096,
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "layer_types": ["linear_attention", "linear_attention", "full_attention",
                        "linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [8, 4, 4], "mrope_interleaved": True},
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "hc_lowrank": 16,
        "ple_layer_ids": [1, 4],
        "ple_embed_dim": 64,
        "ngram_vocab_size_base": 2039,
        "indexer_n_heads": 4,
        "indexer_head_dim": 32,
    },
    "tiny": {
        "vocab_size": 1024,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [4, 2, 2], "mrope_interleaved": True},
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "hc_lowrank": 16,
        "ple_layer_ids": [1, 2],
        "ple_embed_dim": 32,
        "ngram_vocab_size_base": 509,
        "indexer_n_heads": 2,
        "indexer_head_dim": 16,
    },
}


def model_config(preset: str, vocab_size: int | None = None) -> dict:
    """The config.json dict of a preset (vocab_size from the trained tokenizer when given)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(sorted(PRESETS))}")
    config = {**copy.deepcopy(_COMMON), **copy.deepcopy(PRESETS[preset])}
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    return config


def _report(preset: str) -> str:
    import torch

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from mini_mtp import build_models

    model, mtp = build_models(model_config(preset), torch.device("cpu"))
    trunk = sum(p.numel() for p in model.parameters())
    head = sum(p.numel() for p in mtp.parameters())
    by_kind: dict[str, int] = {}
    for name, p in [*model.named_parameters(), *(("mtp." + n, p) for n, p in mtp.named_parameters())]:
        kind = ("embed" if "embed_tokens" in name else "ple" if ".ple." in name else "mtp" if name.startswith("mtp.")
                else "moe" if ".mlp." in name else "gdn" if "linear_attn" in name else "attn" if "self_attn" in name
                else "hyper" if "hyper" in name else "other")
        by_kind[kind] = by_kind.get(kind, 0) + p.numel()
    parts = ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in sorted(by_kind.items()))
    return (f"{preset}: trunk {trunk / 1e6:.2f}M + mtp {head / 1e6:.2f}M parameters; bf16 safetensors about "
            f"{2 * (trunk + head) / 2**20:.1f} MiB ({parts})")


if __name__ == "__main__":
    for name in sys.argv[1:] or sorted(PRESETS):
        print(_report(name))
