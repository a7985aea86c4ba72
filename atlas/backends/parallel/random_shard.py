"""One rank's shard of a random model, drawn on its device (atlas.backends.cuda.random_model per rank): the 80B
benchmark config (~160 GB in bf16) never exists whole in one process.

Replicated tensors are drawn from a seed of (seed, name) alone, so every rank draws the same bits (the router, the
norms: ranks must agree on them); split tensors from (seed, name, rank). Row-parallel slices keep the whole
tensor's 1/sqrt(fan_in) scale, so activations stay O(1) as in the single-GPU random model. A TP=tp random model is
not a slice of a TP=1 random model (benchmarks time it; agreement is checked on models that fit one device).
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch

from atlas.backends.cuda.random_model import random_tensor
from atlas.backends.parallel.shard import TpLayout, check_divisible, local_shape, rule
from atlas.model.loaded import LoadedModel
from atlas.model.spec import ModelSpec
from atlas.model.tokenizer import ByteTokenizer
from atlas.model.weights import expected_shapes


def random_shard(config: dict[str, Any] | str | Path, layout: TpLayout, *, device: str | torch.device,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0
                 ) -> tuple[LoadedModel, dict[str, torch.Tensor]]:
    """(the model's record with no weights, rank's shard) for a config.json, drawn on `device`."""
    if not isinstance(config, dict):
        config = json.loads(Path(config).read_text())
    spec = ModelSpec.from_config(config)
    check_divisible(spec, layout)
    device = torch.device(device)
    shard = {}
    for name, full in sorted(expected_shapes(spec).items()):
        split = rule(spec, layout, name)
        shape = local_shape(spec, layout, name, full)
        g = torch.Generator(device=device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode()) + (layout.rank + 1) * 7919 * (split is not None))
        t = random_tensor(name, shape, g, device, dtype)
        if split is not None and len(full) > 1 and split.dim == len(full) - 1 and "embed" not in name:
            t *= math.sqrt(shape[-1] / full[-1])  # the whole tensor's fan-in
        shard[name] = t
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode() + f":random:{seed}".encode()).hexdigest()
    model = LoadedModel(name=str(config.get("_name_or_path") or spec.model_type), spec=spec, weights={},
                        tokenizer=ByteTokenizer(spec.vocab_size), fingerprint=digest, dtype=dtype)
    return model, shard


def shard_bytes(spec: ModelSpec, layout: TpLayout, itemsize: int) -> int:
    """Weight bytes one rank holds (the first rank: vocab padding goes to the last)."""
    return sum(math.prod(local_shape(spec, layout, n, s)) for n, s in expected_shapes(spec).items()) * itemsize


def shard_stats(spec: ModelSpec, layout: TpLayout, itemsize: int) -> dict[str, int]:
    """Bytes per rank by kind: weights, and the per-sequence state (GDN conv + recurrent in fp32, KV per token).
    For the paper plan past tp = num_key_value_heads (not built: check_divisible refuses it), KV heads are counted
    as replicated, one per rank, and the weights' k/v rows as split (they are ~0.1% of the bytes)."""
    tp = layout.tp
    gdn = len(spec.gdn_layers)
    conv = gdn * (spec.gdn_conv_dim // tp) * spec.gdn_conv_kernel * itemsize
    state = gdn * (spec.gdn_v_heads // tp) * spec.gdn_k_dim * spec.gdn_v_dim * 4
    kv = len(spec.attention_layers) * 2 * max(spec.num_kv_heads // tp, 1) * spec.head_dim * itemsize
    return {"weights": shard_bytes(spec, layout, itemsize), "gdn_state_per_seq": conv + state,
            "kv_per_token": kv}
