"""Checkpoint tensors: safetensors loading, key normalisation, layout conversion and validation.

Atlas names tensors as transformers' text model does, without the `model.` / `model.language_model.`
prefix. Layouts are normalised at load so each backend sees exactly one:
- MoE experts fused: `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]
  (checkpoints may hold per-expert `experts.N.{gate,up,down}_proj.weight`, which save_pretrained writes);
- GDN projections split: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (qwen3_next's fused,
  per-key-head-group `in_proj_qkvz` / `in_proj_ba` are unpacked);
- PLE n-gram tables whole: `ple.ngram_embedding.weight` (checkpoints split them into `split_ngram_parts`);
- `mtp.*` drafter tensors are kept as they are (with the same expert fusing).
"""

from __future__ import annotations

import json
import re
from collections.abc import Container, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from atlas.errors import ModelLoadError
from atlas.model.ngram import ngram_tables
from atlas.model.spec import FULL_ATTENTION, ModelSpec

_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_DROPPED = re.compile(r"^(model\.visual\.|visual\.|model\.vision_tower\.)")
_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<idx>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_NGRAM_SHARD = re.compile(r"^(?P<pre>.*\.ple)\.ple_embedding\.ngram_embedding\.shard_(?P<idx>\d+)\.weight$")
_NGRAM_BUFFER = re.compile(r"^(?P<pre>.*\.ple)\.ple_embedding\.(?P<name>layer_multipliers|ngram_heads_offsets|ngram_heads_vocab_sizes)$")


def safetensor_files(checkpoint_dir: str | Path) -> list[Path]:
    """A checkpoint dir's safetensors files: `model.safetensors`, or the shards a `*.index.json` names."""
    root = Path(checkpoint_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{root}: no safetensors weights (model.safetensors or model.safetensors.index.json)")
    for name in files:
        if not (root / name).is_file():
            raise ModelLoadError(f"{root}: the index names {name}, which is missing")
    return [root / name for name in files]


def read_safetensors(checkpoint_dir: str | Path, skip: Container[str] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint dir but the keys in `skip` (tables read lazily: atlas.model.ngram_rows)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensor_files(checkpoint_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key not in skip:
                    tensors[key] = f.get_tensor(key)
    return tensors


def ngram_table_key(key: str) -> tuple[str, int] | None:
    """(Atlas's name of the whole table, the shard's index; -1 for an unsplit table) for a checkpoint key of a
    PLE n-gram table, else None."""
    name = normalise_key(key)
    if name is None:
        return None
    if m := _NGRAM_SHARD.match(name):
        return f"{m['pre']}.ngram_embedding.weight", int(m["idx"])
    if name.endswith(".ple.ple_embedding.ngram_embedding.weight"):
        return name.replace(".ple_embedding.ngram_embedding.", ".ngram_embedding."), -1
    return None


def normalise_key(key: str) -> str | None:
    """Atlas's name for a checkpoint key, or None for tensors Atlas does not serve (vision tower)."""
    if _DROPPED.match(key):
        return None
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def normalise(spec: ModelSpec, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> Atlas's names and layouts (see the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    ngram_shards: dict[str, dict[int, torch.Tensor]] = {}
    ngram_buffers: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        name = normalise_key(key)
        if name is None:
            continue
        if m := _EXPERT.match(name):
            experts.setdefault(m["pre"], {}).setdefault(m["proj"], {})[int(m["idx"])] = tensor
        elif m := _NGRAM_SHARD.match(name):
            ngram_shards.setdefault(m["pre"], {})[int(m["idx"])] = tensor
        elif m := _NGRAM_BUFFER.match(name):
            ngram_buffers.setdefault(m["pre"], {})[m["name"]] = tensor
        elif name.endswith(".ple.ple_embedding.ngram_embedding.weight"):
            out[name.replace(".ple_embedding.ngram_embedding.", ".ngram_embedding.")] = tensor
        else:
            out[name] = tensor

    for pre, projs in experts.items():
        _fuse_experts(out, pre, projs)
    for pre, shards in ngram_shards.items():
        idx = sorted(shards)
        if idx != list(range(len(idx))) or (spec.ple and len(idx) != spec.ple.split_parts):
            want = spec.ple.split_parts if spec.ple else "?"
            raise ModelLoadError(f"{pre}: n-gram table shards {idx} do not make split_ngram_parts={want} parts")
        out[f"{pre}.ngram_embedding.weight"] = torch.cat([shards[i] for i in idx], dim=0)
    _check_ngram_buffers(spec, ngram_buffers)
    _split_qwen3_next_gdn(spec, out)
    if "lm_head.weight" not in out and spec.tie_word_embeddings and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def _fuse_experts(out: dict[str, torch.Tensor], pre: str, projs: dict[str, dict[int, torch.Tensor]]) -> None:
    for proj in ("gate_proj", "up_proj", "down_proj"):
        if proj not in projs:
            raise ModelLoadError(f"missing tensor {pre}.0.{proj}.weight")
    count = max(max(p) for p in projs.values()) + 1
    for proj, by_idx in projs.items():
        missing = [i for i in range(count) if i not in by_idx]
        if missing:
            raise ModelLoadError(f"missing tensor {pre}.{missing[0]}.{proj}.weight")
    gate = torch.stack([projs["gate_proj"][i] for i in range(count)])
    up = torch.stack([projs["up_proj"][i] for i in range(count)])
    out[f"{pre}.gate_up_proj"] = torch.cat([gate, up], dim=1)
    out[f"{pre}.down_proj"] = torch.stack([projs["down_proj"][i] for i in range(count)])


def _check_ngram_buffers(spec: ModelSpec, buffers: dict[str, dict[str, torch.Tensor]]) -> None:
    if spec.ple is None:
        return
    for rank, layer in enumerate(spec.ple.layers):
        stored = buffers.get(f"layers.{layer}.ple", {})
        tables = ngram_tables(spec.ple, spec.vocab_size, rank)
        derived = {
            "layer_multipliers": tables.multipliers,
            "ngram_heads_vocab_sizes": tables.head_vocab_sizes,
            "ngram_heads_offsets": tables.head_offsets,
        }
        for name, tensor in stored.items():
            if tuple(tensor.tolist()) != derived[name]:
                raise ModelLoadError(
                    f"layers.{layer}.ple.ple_embedding.{name} = {tensor.tolist()} disagrees with the config's "
                    f"n-gram hashing ({list(derived[name])}): check seed / ngram_vocab_size_base"
                )


def _split_qwen3_next_gdn(spec: ModelSpec, out: dict[str, torch.Tensor]) -> None:
    """qwen3_next packs [q, k, v, z] and [b, a] per key-head group; unpack to the split layout."""
    nk, dk, dv = spec.gdn_k_heads, spec.gdn_k_dim, spec.gdn_v_dim
    r = spec.gdn_v_heads // nk
    for key in [k for k in out if k.endswith("linear_attn.in_proj_qkvz.weight")]:
        pre = key[: -len("in_proj_qkvz.weight")]
        w = out.pop(key)
        expect = (nk * (2 * dk + 2 * r * dv), spec.hidden_size)
        if tuple(w.shape) != expect:
            raise ModelLoadError(f"shape mismatch for {key}: checkpoint {tuple(w.shape)}, expected {expect}")
        q, k, v, z = w.view(nk, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
        out[pre + "in_proj_qkv.weight"] = torch.cat([x.reshape(-1, w.shape[-1]) for x in (q, k, v)])
        out[pre + "in_proj_z.weight"] = z.reshape(-1, w.shape[-1])
        ba_key = pre + "in_proj_ba.weight"
        if ba_key not in out:
            raise ModelLoadError(f"missing tensor {ba_key}")
        ba = out.pop(ba_key)
        b, a = ba.view(nk, 2 * r, -1).split([r, r], dim=1)
        out[pre + "in_proj_b.weight"] = b.reshape(-1, ba.shape[-1])
        out[pre + "in_proj_a.weight"] = a.reshape(-1, ba.shape[-1])


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the main model needs, with its shape, in Atlas's names and layouts."""
    h, v = spec.hidden_size, spec.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h)}
    if spec.has_hyper_connections:
        shapes.update(_hyper_shapes(spec, "hyper_connection_mixer", combine=False))
    else:
        shapes["norm.weight"] = (h,)
    for i, kind in enumerate(spec.layer_types):
        pre = f"layers.{i}."
        if spec.has_hyper_connections:
            shapes.update(_hyper_shapes(spec, pre + "attn_hyper_connection", combine=True))
            shapes.update(_hyper_shapes(spec, pre + "mlp_hyper_connection", combine=True))
        else:
            shapes[pre + "input_layernorm.weight"] = (h,)
            shapes[pre + "post_attention_layernorm.weight"] = (h,)
        if kind == FULL_ATTENTION:
            shapes.update(attention_shapes(spec, pre + "self_attn.", with_indexer=spec.qsa is not None))
        else:
            shapes.update(_gdn_shapes(spec, pre + "linear_attn."))
        shapes.update(mlp_shapes(spec, pre + "mlp.", moe=spec.moe_layers[i]))
        if spec.ple and i in spec.ple.layers:
            shapes.update(_ple_shapes(spec, pre + "ple.", spec.ple.layers.index(i)))
    return shapes


def attention_shapes(spec: ModelSpec, pre: str, *, with_indexer: bool) -> dict[str, tuple[int, ...]]:
    h, hd = spec.hidden_size, spec.head_dim
    shapes = {
        pre + "q_proj.weight": (spec.num_heads * hd * 2, h),  # query and its output gate, per head
        pre + "k_proj.weight": (spec.num_kv_heads * hd, h),
        pre + "v_proj.weight": (spec.num_kv_heads * hd, h),
        pre + "o_proj.weight": (h, spec.num_heads * hd),
        pre + "q_norm.weight": (hd,),
        pre + "k_norm.weight": (hd,),
    }
    if with_indexer and spec.qsa is not None:
        q = spec.qsa
        shapes[pre + "indexer.index_qk_proj.weight"] = ((q.n_heads + 1) * q.head_dim, h)
        shapes[pre + "indexer.q_layernorm.weight"] = (q.head_dim,)
        shapes[pre + "indexer.k_layernorm.weight"] = (q.head_dim,)
    return shapes


def mlp_shapes(spec: ModelSpec, pre: str, *, moe: bool) -> dict[str, tuple[int, ...]]:
    h = spec.hidden_size
    if not moe or spec.moe is None:
        i = spec.intermediate_size
        return {pre + "gate_proj.weight": (i, h), pre + "up_proj.weight": (i, h), pre + "down_proj.weight": (h, i)}
    m = spec.moe
    s = m.shared_intermediate_size
    return {
        pre + "gate.weight": (m.num_experts, h),
        pre + "experts.gate_up_proj": (m.num_experts, 2 * m.intermediate_size, h),
        pre + "experts.down_proj": (m.num_experts, h, m.intermediate_size),
        pre + "shared_expert.gate_proj.weight": (s, h),
        pre + "shared_expert.up_proj.weight": (s, h),
        pre + "shared_expert.down_proj.weight": (h, s),
        pre + "shared_expert_gate.weight": (1, h),
    }


def _gdn_shapes(spec: ModelSpec, pre: str) -> dict[str, tuple[int, ...]]:
    h, hv, dv = spec.hidden_size, spec.gdn_v_heads, spec.gdn_v_dim
    return {
        pre + "in_proj_qkv.weight": (spec.gdn_conv_dim, h),
        pre + "in_proj_z.weight": (hv * dv, h),
        pre + "in_proj_b.weight": (hv, h),
        pre + "in_proj_a.weight": (hv, h),
        pre + "conv1d.weight": (spec.gdn_conv_dim, 1, spec.gdn_conv_kernel),
        pre + "dt_bias": (hv,),
        pre + "A_log": (hv,),
        pre + "norm.weight": (dv,),
        pre + "out_proj.weight": (h, hv * dv),
    }


def _hyper_shapes(spec: ModelSpec, pre: str, *, combine: bool) -> dict[str, tuple[int, ...]]:
    wide = spec.hc_count * spec.hidden_size
    shapes = {
        pre + ".hc_norm.weight": (wide,),
        pre + ".input_mix_weight_down.weight": (spec.hc_lowrank, wide),
        pre + ".input_mix_weight_up.weight": (wide, spec.hc_lowrank),
    }
    if combine:
        shapes[pre + ".block_inject_weight.weight"] = (spec.hc_count, wide)
    return shapes


def _ple_shapes(spec: ModelSpec, pre: str, rank: int) -> dict[str, tuple[int, ...]]:
    assert spec.ple is not None
    p = spec.ple
    wide = spec.hc_count * spec.hidden_size
    rows = ngram_tables(p, spec.vocab_size, rank).padded_rows
    return {
        pre + "ngram_embedding.weight": (rows, p.embed_dim // p.num_heads),
        pre + "key_proj.weight": (wide, p.embed_dim),
        pre + "value_proj.weight": (spec.hidden_size, p.embed_dim),
        pre + "norm_key.weight": (wide,),
        pre + "norm_query.weight": (wide,),
        pre + "norm_conv.weight": (wide,),
        pre + "conv1d.weight": (wide, 1, p.conv_kernel),
    }


def mtp_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The MTP drafter head (Qwen3-Next convention): pre-fc norms, fc [H, 2H], decoder layers, final norm."""
    h = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.fc.weight": (h, 2 * h),
        "mtp.norm.weight": (h,),
    }
    for i in range(max(spec.mtp_num_layers, 1)):
        pre = f"mtp.layers.{i}."
        shapes[pre + "input_layernorm.weight"] = (h,)
        shapes[pre + "post_attention_layernorm.weight"] = (h,)
        shapes.update(attention_shapes(spec, pre + "self_attn.", with_indexer=False))
        shapes.update(mlp_shapes(spec, pre + "mlp.", moe=spec.moe is not None))
    return shapes


def validate(spec: ModelSpec, tensors: dict[str, torch.Tensor], names: Iterable[tuple[str, tuple[int, ...]]]) -> None:
    for name, shape in names:
        if name not in tensors:
            raise ModelLoadError(f"missing tensor {name} (shape {shape})")
        got = tuple(tensors[name].shape)
        if got != shape:
            raise ModelLoadError(f"shape mismatch for {name}: checkpoint {got}, expected {shape}")


def load_weights(spec: ModelSpec, raw: dict[str, torch.Tensor], dtype: torch.dtype,
                 lazy: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Normalise and validate checkpoint tensors; cast floating ones to `dtype`. Keeps `mtp.*` if present.
    `lazy`: tensors left in the checkpoint (the n-gram tables a row cache serves), by name; their shapes are
    checked here and they are not among the returned weights."""
    lazy = lazy or {}
    tensors = normalise(spec, raw)
    main = expected_shapes(spec)
    validate(spec, {**tensors, **lazy}, main.items())
    keep = {k: s for k, s in main.items() if k not in lazy}
    if any(k.startswith("mtp.") for k in tensors):
        # the drafter is optional; when present its head must be whole, and all of it is kept
        head = {k: s for k, s in mtp_shapes(spec).items() if not k.startswith("mtp.layers.")}
        validate(spec, tensors, head.items())
        keep.update({k: tuple(t.shape) for k, t in tensors.items() if k.startswith("mtp.")})
    # fresh, aligned copies: safetensors hands out tensors at arbitrary file offsets, and BLAS kernels can
    # round differently on unaligned data, which would make logits depend on the checkpoint's layout
    return {
        k: tensors[k].to(dtype=dtype if tensors[k].is_floating_point() else tensors[k].dtype, copy=True).contiguous()
        for k in keep
    }
