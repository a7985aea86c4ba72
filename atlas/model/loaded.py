"""What a loaded model is (`LoadedModel`) and its fingerprint: below both the loader and atlas-tiny."""

from __future__ import annotations

import hashlib
import json
from typing import Any

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
    # PLE n-gram tables left in the checkpoint (atlas.model.ngram_rows.MmapRows), by name; not in `weights`
    ngram_rows: dict[str, Any] = attrs.field(factory=dict)

    @property
    def has_mtp(self) -> bool:
        return any(k.startswith("mtp.") for k in self.weights)


def fingerprint(config: dict, tensors: dict[str, torch.Tensor], lazy: dict[str, Any] | None = None) -> str:
    """`lazy`: tensors left in the checkpoint (shape, dtype, iter_bytes()), hashed as if they were loaded."""
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    lazy = lazy or {}
    for name in sorted({*tensors, *lazy}):
        if name in lazy:
            h.update(f"{name}:{tuple(lazy[name].shape)}:{lazy[name].dtype}".encode())
            for chunk in lazy[name].iter_bytes():
                h.update(chunk)
            continue
        t = tensors[name].contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
