"""What a model is, shared by both backends: spec from config.json, weights, tokenizer."""

from atlas.errors import ModelLoadError
from atlas.model.loader import TINY_MODEL_NAME, LoadedModel, load_model
from atlas.model.spec import SUPPORTED_MODEL_TYPES, ModelSpec

__all__ = ["SUPPORTED_MODEL_TYPES", "TINY_MODEL_NAME", "LoadedModel", "ModelLoadError", "ModelSpec", "load_model"]
