"""The CUDA data plane: batched device forward, slot-indexed state pools, CUDA graphs for decode."""

from atlas.backends.cuda.random_model import random_model
from atlas.backends.cuda.runner import CudaBackend

__all__ = ["CudaBackend", "random_model"]
