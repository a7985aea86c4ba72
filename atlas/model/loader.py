"""`load_model`: a checkpoint dir, the built-in "atlas-tiny", or the repo's trained "atlas-mini" -> `LoadedModel`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from atlas.errors import ModelLoadError
from atlas.model.loaded import TINY_MODEL_NAME, LoadedModel, fingerprint
from atlas.model.names import MINI_MODEL_DIR, MINI_MODEL_NAME
from atlas.model.ngram_rows import lazy_tables, table_keys
from atlas.model.ngram_rows import ngram_budget as ngram_budget_bytes
from atlas.model.spec import load_spec
from atlas.model.tiny import build_tiny
from atlas.model.tokenizer import load_tokenizer
from atlas.model.weights import load_weights, normalise, read_safetensors


def model_dir(name_or_dir: str | Path) -> Path | None:
    """The checkpoint dir a model name stands for: "atlas-mini" -> the repo's models/atlas-mini, a path -> itself,
    "atlas-tiny" (built in memory) -> None."""
    if str(name_or_dir) == TINY_MODEL_NAME:
        return None
    if str(name_or_dir) == MINI_MODEL_NAME:
        if not (MINI_MODEL_DIR / "config.json").is_file():
            raise ModelLoadError(f"atlas-mini: no checkpoint in {MINI_MODEL_DIR} (tools/train_mini.py trains it; "
                                 "see tools/README.md)")
        return MINI_MODEL_DIR
    return Path(name_or_dir)


def load_model(name_or_dir: str | Path, dtype: torch.dtype = torch.float32, *,
               ngram_budget: int | str | None = None) -> LoadedModel:
    """The model behind a name: "atlas-tiny" is built in memory, "atlas-mini" is the repo's models/atlas-mini;
    anything else is a checkpoint dir. PLE n-gram tables larger together than `ngram_budget` (bytes; None:
    ATLAS_NGRAM_BUDGET, else 16 GiB) stay in the checkpoint, memory-mapped (LoadedModel.ngram_rows), for the
    backends' row caches."""
    root = model_dir(name_or_dir)
    if root is None:
        return build_tiny(dtype=dtype)
    spec = load_spec(root)
    config = json.loads((root / "config.json").read_text())
    lazy = lazy_tables(root, spec)
    if sum(t.shape[0] * t.shape[1] for t in lazy.values()) * dtype.itemsize <= ngram_budget_bytes(ngram_budget):
        lazy = {}
    # the fingerprint covers the normalised tensors, so a checkpoint's layout (shards, prefixes, per-expert
    # tensors) does not change it: atlas-tiny in memory and saved to a dir have the same fingerprint, and so do
    # a model whose n-gram tables stay in the file and the same model loaded whole
    tensors = normalise(spec, read_safetensors(root, skip=table_keys(root, lazy) if lazy else ()))
    weights = load_weights(spec, tensors, dtype, lazy)
    tokenizer = load_tokenizer(root, spec.eos_token_ids, spec.vocab_size)
    return LoadedModel(
        name=root.resolve().name,
        spec=spec,
        weights=weights,
        tokenizer=tokenizer,
        fingerprint=fingerprint(config, tensors, lazy),
        dtype=dtype,
        ngram_rows=lazy,
    )
