"""What a loaded model is (`LoadedModel`) and its fingerprint: below both the loader and atlas-tiny."""

from __future__ import annotations

import hashlib
import json

import attrs
import torch

from atlas.model.names import TINY_MODEL_NAME
from atlas.model.spec import ModelSpec
from atlas.model.tokenizer import Tokenizer

__all__ = ["TINY_MODEL_NAME", "LoadedModel", "fingerprint"]


@attrs.frozen
class LoadedModel:
    name: str  # "atlas-tiny" or the checkpoint dir's basename
    spec: ModelSpec
    weights: dict[str, torch.Tensor]  # Atlas's names and layouts (atlas.model.weights)
    tokenizer: Tokenizer
    fingerprint: str  # sha256 over the config and every tensor's name, shape and bytes
    dtype: torch.dtype

    @property
    def has_mtp(self) -> bool:
        return any(k.startswith("mtp.") for k in self.weights)


def fingerprint(config: dict, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
