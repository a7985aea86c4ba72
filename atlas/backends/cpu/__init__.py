"""The CPU reference backend: readable, exact, and the ground truth the CUDA backend is tested against."""

from atlas.backends.cpu.runner import Chunk, CpuBackend
from atlas.backends.cpu.state import SequenceState, StateSnapshot

__all__ = ["Chunk", "CpuBackend", "SequenceState", "StateSnapshot"]
