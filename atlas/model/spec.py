"""What a model is, read once from a checkpoint's config.json: `ModelSpec`.

Every family Atlas serves is described by one frozen record, so the backends never read config dicts.
A config value the backends cannot honour is refused here, at load, naming the field and its value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from atlas.errors import ModelLoadError

# model_type -> family. `*_text` types are the text towers of the multimodal configs; the multimodal
# types themselves carry the text config nested under `text_config`.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen4_exp": "qwen4_exp",
    "qwen4_exp_text": "qwen4_exp",
}
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
# qwen4_exp names its QSA-carrying full-attention layers "indexed_attention"; Atlas calls them full
# attention layers with a `QsaSpec`.
_LAYER_TYPE_ALIASES = {"linear_attention": LINEAR_ATTENTION, "full_attention": FULL_ATTENTION,
                       "indexed_attention": FULL_ATTENTION}


@attrs.frozen
class QsaSpec:
    """The sparse top-k indexer on full-attention layers."""

    n_heads: int
    head_dim: int
    budget: int  # tokens selected from complete blocks
    ratio: int  # tokens per pooled block

    @property
    def block_topk(self) -> int:
        return self.budget // self.ratio

    @property
    def inert_bound(self) -> int:
        """Attention is dense while the visible prefix n <= this (every complete block is selected)."""
        return self.budget + self.ratio - 1


@attrs.frozen
class PleSpec:
    """Per-layer n-gram embeddings (hashed) injected into the hyper-connection streams."""

    layers: tuple[int, ...]  # zero-based decoder layer indices
    embed_dim: int
    conv_kernel: int
    ngram_size: int
    heads_per_ngram: int
    vocab_base: int
    vocab_divisible_by: int
    seed: int
    split_parts: int
    eos_token_id: int  # n-gram context restarts after it (the first of the config's EOS ids)

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def context_len(self) -> int:
        return self.ngram_size - 1

    @property
    def conv_state_len(self) -> int:
        # the depthwise conv is dilated by ngram_size
        return (self.conv_kernel - 1) * self.ngram_size


@attrs.frozen
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool


@attrs.frozen
class ModelSpec:
    family: str  # qwen3_next | qwen3_5 | qwen3_5_moe | qwen4_exp
    model_type: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # LINEAR_ATTENTION | FULL_ATTENTION per layer
    moe_layers: tuple[bool, ...]  # per layer: sparse MoE block (True) or dense MLP
    rms_norm_eps: float
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    # full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # gated delta net
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_k_dim: int
    gdn_v_dim: int
    gdn_conv_kernel: int
    gdn_gate_act: str  # silu | sigmoid: the activation of z in the gated output norm
    # feed forward
    intermediate_size: int  # dense MLP width (0 when every layer is MoE)
    moe: MoeSpec | None
    # qwen4_exp extras
    hc_count: int = 0  # hyper-connection residual streams; 0 = plain residual with input/post norms
    hc_lowrank: int = 0
    qsa: QsaSpec | None = None
    ple: PleSpec | None = None
    mtp_num_layers: int = 0  # drafter layers the config announces (weights decide whether they are there)
    max_position_embeddings: int | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim

    @property
    def has_hyper_connections(self) -> bool:
        return self.hc_count > 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelSpec:
        return _spec_from_config(config)


def load_spec(checkpoint_dir: str | Path) -> ModelSpec:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{checkpoint_dir}: no config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    return ModelSpec.from_config(config)


def _refuse(field: str, value: Any, why: str) -> ModelLoadError:
    return ModelLoadError(f"config value {field}={value!r} cannot be honoured: {why}")


def _spec_from_config(config: dict[str, Any]) -> ModelSpec:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    family = SUPPORTED_MODEL_TYPES[model_type]
    text = config.get("text_config") or config  # multimodal configs nest the text tower
    if "text_config" in config and not isinstance(text, dict):
        raise _refuse("text_config", text, "expected an object")

    def get(name: str, default: Any = None) -> Any:
        return text.get(name, config.get(name, default))

    num_layers = int(get("num_hidden_layers"))
    layer_types = _layer_types(get("layer_types"), get("full_attention_interval", 4), num_layers)

    hidden_act = get("hidden_act", "silu")
    if hidden_act != "silu":
        raise _refuse("hidden_act", hidden_act, "only silu is implemented")
    if get("attention_bias", False):
        raise _refuse("attention_bias", True, "Atlas's attention has no projection biases")

    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise _refuse("rope_parameters.rope_type", rope_type, "only default RoPE is implemented")
    # text-only serving: every mrope section sees the same text position, so mrope is plain RoPE here
    default_partial = 1.0 if family == "qwen4_exp" else 0.25
    partial = float(rope.get("partial_rotary_factor", get("partial_rotary_factor", default_partial)))
    rope_theta = float(rope.get("rope_theta", get("rope_theta", 10000.0)))
    hidden_size = int(get("hidden_size"))
    num_heads = int(get("num_attention_heads"))
    head_dim = int(get("head_dim") or hidden_size // num_heads)
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or rotary_dim <= 0:
        raise _refuse("partial_rotary_factor", partial, f"rotary dim {rotary_dim} must be even and positive")
    num_kv_heads = int(get("num_key_value_heads", num_heads))
    if num_heads % num_kv_heads:
        raise _refuse("num_key_value_heads", num_kv_heads, f"must divide num_attention_heads={num_heads}")

    gdn_k_heads = int(get("linear_num_key_heads"))
    gdn_v_heads = int(get("linear_num_value_heads"))
    if gdn_v_heads % gdn_k_heads:
        raise _refuse("linear_num_value_heads", gdn_v_heads, f"must be a multiple of linear_num_key_heads={gdn_k_heads}")
    gate_act = get("output_gate_type") or hidden_act if family == "qwen4_exp" else "silu"
    if gate_act not in ("silu", "sigmoid"):
        raise _refuse("output_gate_type", gate_act, "supported: silu, sigmoid")

    moe, moe_layers = _moe(family, get, num_layers)
    eos = get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    qsa = _qsa(get, rotary_dim) if family == "qwen4_exp" else None
    ple = _ple(get, layer_types, eos_ids) if family == "qwen4_exp" else None
    hc_count = int(get("hc_count", 4)) if family == "qwen4_exp" else 0
    if family == "qwen4_exp" and hc_count < 2:
        raise _refuse("hc_count", hc_count, "qwen4_exp needs at least 2 hyper-connection streams")

    return ModelSpec(
        family=family,
        model_type=model_type,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden_size,
        layer_types=layer_types,
        moe_layers=moe_layers,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        eos_token_ids=eos_ids,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", get("tie_word_embeddings", False))),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=rope_theta,
        gdn_k_heads=gdn_k_heads,
        gdn_v_heads=gdn_v_heads,
        gdn_k_dim=int(get("linear_key_head_dim")),
        gdn_v_dim=int(get("linear_value_head_dim")),
        gdn_conv_kernel=int(get("linear_conv_kernel_dim", 4)),
        gdn_gate_act=gate_act,
        intermediate_size=int(get("intermediate_size") or 0) if not all(moe_layers) else 0,
        moe=moe,
        hc_count=hc_count,
        hc_lowrank=int(get("hc_lowrank", 0)) if hc_count else 0,
        qsa=qsa,
        ple=ple,
        mtp_num_layers=int(get("mtp_num_hidden_layers", 0) or 0),
        max_position_embeddings=int(get("max_position_embeddings")) if get("max_position_embeddings") else None,
    )


def _layer_types(raw: list[str] | None, interval: int, num_layers: int) -> tuple[str, ...]:
    if raw is None:
        raw = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    if len(raw) != num_layers:
        raise _refuse("layer_types", raw, f"has {len(raw)} entries for num_hidden_layers={num_layers}")
    unknown = sorted({t for t in raw if t not in _LAYER_TYPE_ALIASES})
    if unknown:
        raise _refuse("layer_types", unknown, f"supported: {', '.join(sorted(_LAYER_TYPE_ALIASES))}")
    return tuple(_LAYER_TYPE_ALIASES[t] for t in raw)


def _moe(family: str, get: Any, num_layers: int) -> tuple[MoeSpec | None, tuple[bool, ...]]:
    if family == "qwen3_5":
        return None, (False,) * num_layers
    num_experts = int(get("num_experts", 0) or 0)
    if num_experts <= 0:
        if family != "qwen3_next":
            raise _refuse("num_experts", num_experts, f"{family} is a mixture-of-experts family")
        return None, (False,) * num_layers
    top_k = int(get("num_experts_per_tok"))
    if not 0 < top_k <= num_experts:
        raise _refuse("num_experts_per_tok", top_k, f"must be in [1, num_experts={num_experts}]")
    moe = MoeSpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(get("moe_intermediate_size")),
        shared_intermediate_size=int(get("shared_expert_intermediate_size", 0) or 0),
        norm_topk_prob=bool(get("norm_topk_prob", True)),
    )
    if family == "qwen3_next":
        step = int(get("decoder_sparse_step", 1) or 1)
        dense_only = set(get("mlp_only_layers") or [])
        layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
    else:
        layers = (True,) * num_layers
    if moe.shared_intermediate_size <= 0:
        raise _refuse("shared_expert_intermediate_size", moe.shared_intermediate_size, "a shared expert is required")
    return moe, layers


def _qsa(get: Any, rotary_dim: int) -> QsaSpec | None:
    fields = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    values = {f: get(f) for f in fields}
    if all(v is None for v in values.values()):
        # qwen4_exp without an indexer: plain dense attention on its full-attention layers
        return None
    for f, v in values.items():
        if v is None or int(v) <= 0:
            raise _refuse(f, v, "every QSA field must be set and positive")
    if int(values["indexer_kv_heads"]) != 1:
        raise _refuse("indexer_kv_heads", values["indexer_kv_heads"], "QSA uses exactly one index key head")
    budget, ratio = int(values["indexer_budget"]), int(values["indexer_compress_ratio"])
    if budget % ratio:
        raise _refuse("indexer_budget", budget, f"must be a multiple of indexer_compress_ratio={ratio}")
    head_dim = int(values["indexer_head_dim"])
    if rotary_dim > head_dim:
        raise _refuse("indexer_head_dim", head_dim, f"must hold the attention's rotary dim {rotary_dim}")
    return QsaSpec(n_heads=int(values["indexer_n_heads"]), head_dim=head_dim, budget=budget, ratio=ratio)


def _ple(get: Any, layer_types: tuple[str, ...], eos_ids: tuple[int, ...]) -> PleSpec | None:
    ids = sorted(set(get("ple_layer_ids") or []))
    if not ids:
        return None
    bad = [i for i in ids if not 1 <= i <= len(layer_types) or layer_types[i - 1] != LINEAR_ATTENTION]
    if bad:
        raise _refuse("ple_layer_ids", bad, "PLE ids are one-based and must name linear-attention layers")
    if not eos_ids:
        raise _refuse("eos_token_id", None, "PLE n-gram context restarts at EOS, so one must be set")
    spec = PleSpec(
        layers=tuple(i - 1 for i in ids),
        embed_dim=int(get("ple_embed_dim") or get("hidden_size")),
        conv_kernel=int(get("ple_conv_kernel_size", 4)),
        ngram_size=int(get("ngram_size", 3)),
        heads_per_ngram=int(get("heads_per_ngram", 8)),
        vocab_base=int(get("ngram_vocab_size_base", 20_000_000)),
        vocab_divisible_by=int(get("make_ngram_vocab_size_divisible_by", 128)),
        seed=int(get("seed", 1234)),
        split_parts=int(get("split_ngram_parts", 512)),
        eos_token_id=eos_ids[0],
    )
    if spec.num_heads <= 0 or spec.embed_dim % spec.num_heads:
        raise _refuse("ple_embed_dim", spec.embed_dim, f"must be a multiple of the {spec.num_heads} n-gram heads")
    return spec
