"""The built-in model names (torch-free: the CLI checks its arguments without importing torch)."""

from __future__ import annotations

from pathlib import Path

TINY_MODEL_NAME = "atlas-tiny"  # random weights, built in memory (fast tests)
MINI_MODEL_NAME = "atlas-mini"
# the checkpoint tools/train_mini.py trained, committed in the repo; found next to the package, so the name
# works from a checkout (and its editable install) whatever the working directory
MINI_MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / MINI_MODEL_NAME
