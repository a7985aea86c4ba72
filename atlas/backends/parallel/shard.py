"""Which slice of every weight a tensor-parallel rank holds, and the rank's shard of a full weight dict.

One rule per tensor (`rule`), in Atlas's names and layouts (atlas.model.weights):
- attention: q_proj (query + gate, 2 * head_dim rows per head), k_proj, v_proj split by head (column parallel),
  o_proj by its input (row parallel, the output is a partial sum: one all-reduce per layer); q/k norms and the
  QSA indexer replicated (the indexer's selection is per sequence, shared by every head: each rank computes it);
- GDN: in_proj_qkv and conv1d split per segment [q | k | v] by head, in_proj_z/b/a, A_log and dt_bias by value
  head, out_proj row parallel; the conv and recurrent state pools are then per-rank by construction;
- dense MLP and the shared expert: gate/up column parallel, down row parallel; the router and the shared
  expert's sigmoid gate replicated (every rank needs the full top-k);
- routed experts: "tp" splits each expert's intermediate dim (gate/up rows, down columns), "ep" gives rank r the
  experts [r * E / tp, (r + 1) * E / tp) whole;
- embed_tokens and lm_head vocab parallel (rows split, the last rank padded with zero rows when tp does not
  divide the vocabulary);
- everything else (norms, hyper-connections, PLE) replicated; mtp.* dropped (no drafter under TP).

`local_spec` is the ModelSpec a rank's layer math runs with: its head counts and widths divided by tp, the
vocabulary and expert count left whole (token checks and the router see the full model).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

import attrs
import torch

from atlas.model.spec import ModelSpec

ExpertMode = Literal["tp", "ep"]
EXPERT_MODES: tuple[ExpertMode, ...] = ("tp", "ep")


@attrs.frozen
class Split:
    """Split `dim` of a tensor across ranks, each of the consecutive `segments` (sizes along dim; () = the whole
    dim is one segment) evenly; rank r keeps the r-th part of every segment, concatenated in order. `pad_to`:
    the dim is first padded with zeros to this size (vocab-parallel tables)."""

    dim: int
    segments: tuple[int, ...] = ()
    pad_to: int = 0


REPLICATED = None


@attrs.frozen
class TpLayout:
    """How a model is split: the degree, the rank, and the routed experts' mode."""

    tp: int
    rank: int
    experts: ExpertMode = "tp"

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} outside [0, tp={self.tp})")
        if self.experts not in EXPERT_MODES:
            raise ValueError(f"expert mode {self.experts!r}: expected one of {EXPERT_MODES}")


def padded_vocab(spec: ModelSpec, tp: int) -> int:
    return -(-spec.vocab_size // tp) * tp


def vocab_range(spec: ModelSpec, layout: TpLayout) -> tuple[int, int]:
    """The token ids [lo, hi) of rank's embedding and lm_head rows (hi may pass the vocabulary: padding)."""
    part = padded_vocab(spec, layout.tp) // layout.tp
    return layout.rank * part, (layout.rank + 1) * part


def check_divisible(spec: ModelSpec, layout: TpLayout) -> None:
    """Refuse a degree the model's heads or widths do not divide, naming both numbers."""
    tp = layout.tp
    need = {"num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
            "linear_num_key_heads": spec.gdn_k_heads, "linear_num_value_heads": spec.gdn_v_heads}
    if spec.intermediate_size:
        need["intermediate_size"] = spec.intermediate_size
    if spec.moe is not None:
        need["shared_expert_intermediate_size"] = spec.moe.shared_intermediate_size
        if layout.experts == "tp":
            need["moe_intermediate_size"] = spec.moe.intermediate_size
        else:
            need["num_experts"] = spec.moe.num_experts
    for field, value in need.items():
        if value % tp:
            # (replicating KV heads when tp > num_key_value_heads, as vLLM does, is not built)
            raise ValueError(f"tensor parallel size {tp} does not divide {field}={value}")


def local_spec(spec: ModelSpec, layout: TpLayout) -> ModelSpec:
    """The spec rank's layer math runs with (heads and widths per rank; vocabulary and experts whole)."""
    check_divisible(spec, layout)
    tp = layout.tp
    moe = spec.moe
    if moe is not None:
        moe = attrs.evolve(moe, shared_intermediate_size=moe.shared_intermediate_size // tp,
                           intermediate_size=moe.intermediate_size // tp if layout.experts == "tp"
                           else moe.intermediate_size)
    return attrs.evolve(spec, num_heads=spec.num_heads // tp, num_kv_heads=spec.num_kv_heads // tp,
                        gdn_k_heads=spec.gdn_k_heads // tp, gdn_v_heads=spec.gdn_v_heads // tp,
                        intermediate_size=spec.intermediate_size // tp, moe=moe, mtp_num_layers=0)


_LAYER = re.compile(r"^layers\.\d+\.")


def rule(spec: ModelSpec, layout: TpLayout, name: str) -> Split | None:
    """The split of tensor `name` (Atlas's names and layouts), or None: replicated."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return Split(0, pad_to=padded_vocab(spec, layout.tp))
    tail = _LAYER.sub("", name)
    qk = spec.gdn_k_heads * spec.gdn_k_dim
    table: dict[str, Split] = {
        "self_attn.q_proj.weight": Split(0),
        "self_attn.k_proj.weight": Split(0),
        "self_attn.v_proj.weight": Split(0),
        "self_attn.o_proj.weight": Split(1),
        "linear_attn.in_proj_qkv.weight": Split(0, (qk, qk, spec.gdn_v_heads * spec.gdn_v_dim)),
        "linear_attn.conv1d.weight": Split(0, (qk, qk, spec.gdn_v_heads * spec.gdn_v_dim)),
        "linear_attn.in_proj_z.weight": Split(0),
        "linear_attn.in_proj_b.weight": Split(0),
        "linear_attn.in_proj_a.weight": Split(0),
        "linear_attn.A_log": Split(0),
        "linear_attn.dt_bias": Split(0),
        "linear_attn.out_proj.weight": Split(1),
        "mlp.gate_proj.weight": Split(0),
        "mlp.up_proj.weight": Split(0),
        "mlp.down_proj.weight": Split(1),
        "mlp.shared_expert.gate_proj.weight": Split(0),
        "mlp.shared_expert.up_proj.weight": Split(0),
        "mlp.shared_expert.down_proj.weight": Split(1),
    }
    if spec.moe is not None:
        inter = spec.moe.intermediate_size
        if layout.experts == "tp":
            table["mlp.experts.gate_up_proj"] = Split(1, (inter, inter))  # [E, 2I, H]: gate rows then up rows
            table["mlp.experts.down_proj"] = Split(2)  # [E, H, I]
        else:
            table["mlp.experts.gate_up_proj"] = Split(0)
            table["mlp.experts.down_proj"] = Split(0)
    return table.get(tail, REPLICATED)


def part_ranges(split: Split, size: int, layout: TpLayout) -> list[tuple[int, int]]:
    """The [lo, hi) index ranges along split.dim that rank keeps, in order (before padding is applied, a range
    may reach past `size`: those rows are zeros)."""
    full = split.pad_to or size
    segments = split.segments or (full,)
    if sum(segments) != full:
        raise ValueError(f"segments {segments} do not add up to the dim's {full}")
    out, base = [], 0
    for seg in segments:
        if seg % layout.tp:
            raise ValueError(f"tensor parallel size {layout.tp} does not divide a segment of {seg}")
        part = seg // layout.tp
        out.append((base + layout.rank * part, base + (layout.rank + 1) * part))
        base += seg
    return out


def local_shape(spec: ModelSpec, layout: TpLayout, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    split = rule(spec, layout, name)
    if split is None:
        return shape
    width = sum(hi - lo for lo, hi in part_ranges(split, shape[split.dim], layout))
    return (*shape[: split.dim], width, *shape[split.dim + 1 :])


def assemble(split: Split, shape: tuple[int, ...], layout: TpLayout,
             take: Callable[[int, int], torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank's part of a tensor of `shape` under `split`, from `take(lo, hi)` (the full tensor's [lo, hi) along
    split.dim, hi <= the dim's size): an in-memory narrow, or a memory-mapped safetensors slice. Padding rows
    are zeros of the pieces' dtype (`dtype` when the rank's whole range is padding)."""
    size = shape[split.dim]
    parts = []
    for lo, hi in part_ranges(split, size, layout):
        piece = take(min(lo, size), min(hi, size)) if lo < size else None
        if hi > size:  # vocab padding: zero rows past the vocabulary
            pad = list(shape)
            pad[split.dim] = hi - max(lo, size)
            if piece is None:
                piece = torch.zeros(pad, dtype=dtype)
            else:
                piece = torch.cat([piece, piece.new_zeros(pad)], dim=split.dim)
        parts.append(piece)
    return torch.cat(parts, dim=split.dim).contiguous() if len(parts) > 1 else parts[0].contiguous()


def slice_tensor(t: torch.Tensor, split: Split | None, layout: TpLayout) -> torch.Tensor:
    """Rank's part of a full tensor under `split` (a fresh contiguous copy)."""
    if split is None:
        return t.contiguous().clone()
    dim = split.dim
    return assemble(split, tuple(t.shape), layout, lambda lo, hi: t.narrow(dim, lo, hi - lo), t.dtype).clone()


def shard_weights(spec: ModelSpec, weights: dict[str, torch.Tensor], layout: TpLayout) -> dict[str, torch.Tensor]:
    """Rank's shard of a full weight dict (Atlas's names; mtp.* dropped)."""
    check_divisible(spec, layout)
    return {name: slice_tensor(t, rule(spec, layout, name), layout)
            for name, t in weights.items() if not name.startswith("mtp.")}
