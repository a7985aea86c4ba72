"""A `LoadedModel` with random weights built straight from a config.json, on any device.

For benchmarks on models whose checkpoints are not on disk (the 2.76 B-parameter benchmark model is 5.5 GB
in bf16): every tensor is drawn on the target device in the target dtype, at the same scales as
atlas-tiny's weights (atlas.model.tiny), so activations and logits stay O(1) and no NaN hides a bug.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from atlas.model.loader import LoadedModel
from atlas.model.spec import ModelSpec
from atlas.model.tokenizer import ByteTokenizer
from atlas.model.weights import expected_shapes


def random_tensor(name: str, shape: tuple[int, ...], g: torch.Generator, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
    # drawn in fp32 then cast: bf16 normal_ would round the scale into the distribution's shape
    t = torch.empty(shape, device=device, dtype=torch.float32)
    if name.endswith("A_log"):
        t.uniform_(0.0, 1.5, generator=g)
    elif name.endswith("dt_bias"):
        t.normal_(0.0, 0.5, generator=g)
    elif name.endswith("linear_attn.norm.weight"):
        t.normal_(1.0, 0.1, generator=g)
    elif len(shape) == 1:
        t.normal_(0.0, 0.1, generator=g)
    elif "embed" in name:
        t.normal_(0.0, 1.0, generator=g)
    else:
        t.normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=g)
    return t.to(dtype)


def random_model(config: dict[str, Any] | str | Path, *, device: str | torch.device = "cuda",
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> LoadedModel:
    """The model a config.json describes, with random weights drawn on `device` (no checkpoint needed).

    The tokenizer is the byte tokenizer (ids beyond 256 + its specials are never produced by it, but the
    model may sample them; benchmarks feed ids directly). The fingerprint covers the config and the seed.
    """
    if not isinstance(config, dict):
        config = json.loads(Path(config).read_text())
    spec = ModelSpec.from_config(config)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {name: random_tensor(name, shape, g, device, dtype)
               for name, shape in sorted(expected_shapes(spec).items())}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode() + f":random:{seed}".encode()).hexdigest()
    return LoadedModel(name=str(config.get("_name_or_path") or spec.model_type), spec=spec, weights=weights,
                       tokenizer=ByteTokenizer(spec.vocab_size), fingerprint=digest, dtype=dtype)
