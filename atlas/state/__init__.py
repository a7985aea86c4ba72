"""The control plane: typed state machines, events and invariants. Pure Python, no tensors.

Importing the package registers every transition on ControlState (requests, steps, rollbacks, prefix)."""

from atlas.state import prefix, requests, rollbacks, steps  # noqa: F401 (registers the transitions)
from atlas.state.control import ControlState

__all__ = ["ControlState"]
