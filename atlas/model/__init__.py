"""What a model is, shared by both backends: spec from config.json, weights, tokenizer.

The names below load on first use (a module __getattr__): importing a torch-free submodule such as
atlas.model.names (the CLI's argument checks) must not import the loader and with it torch (7.1 of the CLI's
7.4 s of start-up imports on a 2-core box; `atlas --help` 3.5 -> 0.4 s of CPU with this)."""

from typing import Any

from atlas.errors import ModelLoadError

__all__ = ["SUPPORTED_MODEL_TYPES", "TINY_MODEL_NAME", "LoadedModel", "ModelLoadError", "ModelSpec", "load_model"]


def __getattr__(name: str) -> Any:
    if name in ("TINY_MODEL_NAME", "LoadedModel", "load_model"):
        from atlas.model import loader

        return getattr(loader, name)
    if name in ("SUPPORTED_MODEL_TYPES", "ModelSpec"):
        from atlas.model import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'atlas.model' has no attribute {name!r}")
