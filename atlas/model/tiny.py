"""The built-in model "atlas-tiny": qwen4_exp-shaped with every feature on, random weights, byte tokenizer.

GDN + QSA attention (ratio 4, budget 16: dense while the visible prefix is <= 19 tokens, sparse after),
PLE on two GDN layers, two hyper-connection streams, MoE on every layer, and an MTP drafter head
(`mtp.*`, Qwen3-Next convention). Built in memory from a fixed seed in well under a second, so
`atlas serve` works with nothing downloaded; `save(dir)` writes it as a transformers-style checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from atlas.model.loaded import TINY_MODEL_NAME, LoadedModel, fingerprint
from atlas.model.ngram import ngram_tables
from atlas.model.spec import ModelSpec
from atlas.model.tokenizer import ByteTokenizer
from atlas.model.weights import expected_shapes, load_weights, mtp_shapes

TINY_SEED = 20260301
EOS = 256  # ByteTokenizer's <|endoftext|>

TINY_CONFIG: dict = {
    "architectures": ["Qwen4ExpForCausalLM"],
    "model_type": "qwen4_exp_text",
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True,
    "hc_count": 2,
    "hc_lowrank": 16,
    "ple_layer_ids": [1, 2],
    "ple_embed_dim": 32,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 1009,
    "make_ngram_vocab_size_divisible_by": 8,
    "split_ngram_parts": 4,
    "seed": 1234,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
    "mtp_num_hidden_layers": 1,
    "eos_token_id": EOS,
    "bos_token_id": None,
    "pad_token_id": None,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
}


def _random_tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Scales that keep activations and logits O(1): unit embeddings, 1/sqrt(fan_in) matrices, norm
    weights near their identity (0 for zero-centred RMSNorm, 1 for GDN's gated norm)."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.0, 1.5, generator=g)
    if name.endswith("dt_bias"):
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if len(shape) == 1:
        return 0.1 * torch.randn(shape, generator=g)
    if "embed" in name:
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / math.sqrt(shape[-1])


def tiny_tensors(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every tensor of atlas-tiny (main model and drafter) in Atlas's names and layouts, from TINY_SEED."""
    g = torch.Generator().manual_seed(TINY_SEED)
    shapes = {**expected_shapes(spec), **mtp_shapes(spec)}
    tensors = {name: _random_tensor(name, shape, g) for name, shape in sorted(shapes.items())}
    # keep greedy text-like: printable ASCII a little louder, EOS quiet (not silent), unused ids silent
    head = tensors["lm_head.weight"]
    head[32:127] *= 1.5
    head[EOS] *= 0.3
    head[256 + len(ByteTokenizer.SPECIALS) :] = 0.0  # ids past the byte tokenizer's specials
    return tensors


def build_tiny(dtype: torch.dtype = torch.float32) -> LoadedModel:
    spec = ModelSpec.from_config(TINY_CONFIG)
    tensors = tiny_tensors(spec)
    return LoadedModel(
        name=TINY_MODEL_NAME,
        spec=spec,
        weights=load_weights(spec, tensors, dtype),
        tokenizer=ByteTokenizer(spec.vocab_size),
        fingerprint=fingerprint(TINY_CONFIG, tensors),
        dtype=dtype,
    )


def _checkpoint_key(name: str) -> str:
    return name if name.startswith(("lm_head.", "mtp.")) else "model." + name


def save(directory: str | Path) -> Path:
    """Write atlas-tiny as a checkpoint dir (config.json + model.safetensors) in transformers' layout:
    `model.` prefixes, PLE n-gram tables split into `split_ngram_parts` shards."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    spec = ModelSpec.from_config(TINY_CONFIG)
    out: dict[str, torch.Tensor] = {}
    for name, t in tiny_tensors(spec).items():
        if name.endswith("ple.ngram_embedding.weight") and spec.ple is not None:
            pre = name[: -len("ngram_embedding.weight")]
            for i, part in enumerate(t.chunk(spec.ple.split_parts, dim=0)):
                out[_checkpoint_key(f"{pre}ple_embedding.ngram_embedding.shard_{i}.weight")] = part.contiguous()
            # transformers keeps the hashing tables as buffers; write them so its loader finds them too
            tables = ngram_tables(spec.ple, spec.vocab_size, spec.ple.layers.index(int(name.split(".")[1])))
            for buffer, values in (("layer_multipliers", tables.multipliers),
                                   ("ngram_heads_vocab_sizes", tables.head_vocab_sizes),
                                   ("ngram_heads_offsets", tables.head_offsets)):
                out[_checkpoint_key(f"{pre}ple_embedding.{buffer}")] = torch.tensor(values, dtype=torch.long)
        else:
            out[_checkpoint_key(name)] = t.contiguous()
    save_file(out, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2, sort_keys=True))
    return root
