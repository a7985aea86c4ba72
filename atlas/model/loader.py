"""`load_model`: a checkpoint dir (or the built-in "atlas-tiny") -> `LoadedModel`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from atlas.model.loaded import TINY_MODEL_NAME, LoadedModel, fingerprint
from atlas.model.spec import load_spec
from atlas.model.tiny import build_tiny
from atlas.model.tokenizer import load_tokenizer
from atlas.model.weights import load_weights, normalise, read_safetensors


def load_model(name_or_dir: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The model behind a name: "atlas-tiny" is built in memory; anything else is a checkpoint dir."""
    if str(name_or_dir) == TINY_MODEL_NAME:
        return build_tiny(dtype=dtype)
    root = Path(name_or_dir)
    spec = load_spec(root)
    config = json.loads((root / "config.json").read_text())
    # the fingerprint covers the normalised tensors, so a checkpoint's layout (shards, prefixes, per-expert
    # tensors) does not change it: atlas-tiny in memory and saved to a dir have the same fingerprint
    tensors = normalise(spec, read_safetensors(root))
    weights = load_weights(spec, tensors, dtype)
    tokenizer = load_tokenizer(root, spec.eos_token_ids, spec.vocab_size)
    return LoadedModel(
        name=root.resolve().name,
        spec=spec,
        weights=weights,
        tokenizer=tokenizer,
        fingerprint=fingerprint(config, tensors),
        dtype=dtype,
    )
