"""Read only one rank's slices of a safetensors checkpoint (memory-mapped `safe_open(...).get_slice`), so a
checkpoint larger than one process's memory loads as `tp` shards.

Checkpoint layouts are handled before slicing where a slice of the stored tensor is a slice of Atlas's layout:
qwen3_next's packed `in_proj_qkvz` / `in_proj_ba` are laid out per key-head group, so a contiguous row range is
the rank's key heads (unpacked afterwards with the rank's spec); per-expert `experts.N.*` tensors are read whole
for the rank's experts (EP, renumbered from 0) or by intermediate width (TP). Then the checkpoint's own
normalisation (atlas.model.weights.normalise) runs on the slices with the rank's spec, and every tensor is
checked against its full shape's slice.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from atlas.backends.parallel.shard import Split, TpLayout, assemble, local_shape, local_spec, rule
from atlas.errors import ModelLoadError
from atlas.model.spec import ModelSpec, load_spec
from atlas.model.weights import expected_shapes, normalise, normalise_key

_EXPERT = re.compile(r"^(?P<pre>.*\.experts)\.(?P<idx>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def checkpoint_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint dir (as atlas.model.weights.read_safetensors finds them)."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    elif (root / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        names = sorted(p.name for p in root.glob("*.safetensors"))
    if not names:
        raise ModelLoadError(f"{root}: no safetensors weights (model.safetensors or model.safetensors.index.json)")
    return [root / n for n in names]


def checkpoint_rule(spec: ModelSpec, layout: TpLayout, name: str) -> tuple[Split | None, str | None]:
    """(the split of checkpoint tensor `name` (Atlas-prefixed), the key to store it under), or (None, None) to
    skip it. Layouts Atlas converts at load are split in the checkpoint's own layout."""
    if name.startswith("mtp."):
        return None, None
    if m := _EXPERT.match(name):
        if layout.experts == "ep":
            per = spec.moe.num_experts // layout.tp if spec.moe else 0
            idx = int(m["idx"]) - layout.rank * per
            return (None, f"{m['pre']}.{idx}.{m['proj']}.weight") if 0 <= idx < per else (None, None)
        return Split(1 if m["proj"] == "down_proj" else 0), name
    if name.endswith(("linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight")):
        return Split(0), name  # per key-head group: a row range is the rank's key heads
    return rule(spec, layout, name), name


def load_shard(checkpoint_dir: str | Path, layout: TpLayout, dtype: torch.dtype = torch.float32
               ) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """(the full spec, rank's shard in Atlas's names and layouts, cast to `dtype`) without reading the rest."""
    root = Path(checkpoint_dir)
    spec = load_spec(root)
    rank_spec = local_spec(spec, layout)
    raw: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(root):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = normalise_key(key)
                if name is None:
                    continue
                split, store = checkpoint_rule(spec, layout, name)
                if store is None:
                    continue
                raw[store] = _read(f.get_slice(key), split, layout)
    tensors = normalise(rank_spec, raw)  # expert fusing, qwen3_next unpacking, PLE tables, tied lm_head
    want = {n: local_shape(spec, layout, n, s) for n, s in expected_shapes(spec).items()}
    for name, shape in want.items():
        if name not in tensors:
            raise ModelLoadError(f"missing tensor {name} (rank {layout.rank}'s shape {shape})")
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(f"shape mismatch for {name} on rank {layout.rank} of {layout.tp}: read "
                                 f"{tuple(tensors[name].shape)}, expected {shape}")
    return spec, {n: tensors[n].to(dtype=dtype if tensors[n].is_floating_point() else tensors[n].dtype, copy=True)
                  .contiguous() for n in want}


def _read(sl: Any, split: Split | None, layout: TpLayout) -> torch.Tensor:
    if split is None:
        return sl[:]
    shape = tuple(sl.get_shape())

    def take(lo: int, hi: int) -> torch.Tensor:
        index = (slice(None),) * split.dim + (slice(lo, hi),)
        return sl[index]

    return assemble(split, shape, layout, take)
