"""PLE n-gram tables left in the checkpoint: rows read from the memory-mapped safetensors file on demand.

A real checkpoint's n-gram tables (~90 GiB) do not fit a GPU, nor sensibly a host's memory. When the tables
are larger than the n-gram budget (`ATLAS_NGRAM_BUDGET`, or the `ngram_budget` argument), `load_model` leaves
them in the file as `MmapRows` (numpy memmaps over the safetensors data; nothing is read until a row is asked
for) and the backends serve them through the row cache (atlas.model.ngram_cache). Tables within the budget are
loaded whole, as every other tensor.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atlas.errors import CapacityError, ModelLoadError
from atlas.model.spec import ModelSpec
from atlas.model.weights import ngram_table_key, safetensor_files

NGRAM_BUDGET_ENV = "ATLAS_NGRAM_BUDGET"
DEFAULT_NGRAM_BUDGET = 16 << 30  # bytes of n-gram tables held whole (per backend, in its dtype)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# safetensors dtype -> (numpy dtype of the stored bits, torch dtype they are)
_DTYPES = {"BF16": (np.uint16, torch.bfloat16), "F16": (np.float16, torch.float16), "F32": (np.float32, torch.float32),
           "F64": (np.float64, torch.float64)}


def ngram_budget(value: int | str | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The n-gram budget in bytes: `value` (bytes, or a string like "512M", "2G"), else ATLAS_NGRAM_BUDGET, else
    16 GiB. A malformed or negative value is a CapacityError naming the knob."""
    env = os.environ if environ is None else environ
    source = NGRAM_BUDGET_ENV
    if value is None:
        value = env.get(NGRAM_BUDGET_ENV)
    else:
        source = "ngram_budget"
    if value is None or value == "":
        return DEFAULT_NGRAM_BUDGET
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in _UNITS and text[-1:] else ""
        try:
            number = int(float(text[: len(text) - len(unit)]) * _UNITS[unit])
        except ValueError:
            raise CapacityError(f"{source}={value!r} is not a size in bytes (e.g. 0, 512M, 16G)") from None
    if number < 0:
        raise CapacityError(f"{source}={value!r} is negative")
    return number


class MmapRows:
    """One n-gram table [rows, dim] as it lies in the checkpoint: its shards (split_ngram_parts of them, or one)
    memory-mapped, concatenated by row. `gather(rows)` reads only the rows asked for."""

    def __init__(self, name: str, parts: list[tuple[Path, int, tuple[int, int], str]]) -> None:
        self.name = name
        self.parts = []
        starts = [0]
        dim = parts[0][2][1]
        for path, offset, shape, dtype in parts:
            if dtype not in _DTYPES:
                raise ModelLoadError(f"{name}: n-gram table stored as {dtype}; the row cache reads {', '.join(_DTYPES)}")
            if shape[1] != dim or dtype != parts[0][3]:
                raise ModelLoadError(f"{name}: its shards disagree on the row width or dtype")
            bits = _DTYPES[dtype][0]
            self.parts.append(np.memmap(path, dtype=bits, mode="r", offset=offset, shape=shape))
            starts.append(starts[-1] + shape[0])
        self.starts = np.array(starts, dtype=np.int64)
        self.shape = (int(starts[-1]), dim)
        self.dtype = _DTYPES[parts[0][3]][1]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize

    def gather(self, rows: np.ndarray) -> torch.Tensor:
        """Rows [n] (int64) -> [n, dim] in the checkpoint's dtype, read from the files."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.shape[0]):
            raise IndexError(f"{self.name}: rows outside [0, {self.shape[0]})")
        part = np.searchsorted(self.starts, rows, side="right") - 1
        out = np.empty((len(rows), self.shape[1]), dtype=self.parts[0].dtype)
        for p in np.unique(part):
            at = np.flatnonzero(part == p)
            out[at] = self.parts[p][rows[at] - self.starts[p]]
        return torch.from_numpy(out).view(self.dtype)

    def iter_bytes(self, chunk: int = 64 << 20) -> Iterator[memoryview]:
        """The table's bytes in order (what hashing the loaded table would read), a chunk at a time."""
        for part in self.parts:
            flat = part.reshape(-1).view(np.uint8)
            for at in range(0, len(flat), chunk):
                yield memoryview(np.ascontiguousarray(flat[at : at + chunk]))


class TensorRows:
    """A resident table as a row source (a model loaded whole, served through the cache all the same)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.shape = tuple(table.shape)

    def gather(self, rows: np.ndarray) -> torch.Tensor:
        return self.table[torch.from_numpy(np.asarray(rows, dtype=np.int64))]


def lazy_tables(checkpoint_dir: str | Path, spec: ModelSpec) -> dict[str, MmapRows]:
    """Every PLE n-gram table of a checkpoint as MmapRows, by Atlas's name (empty without PLE)."""
    if spec.ple is None:
        return {}
    found: dict[str, dict[int, tuple[Path, int, tuple[int, int], str]]] = {}
    for path in safetensor_files(checkpoint_dir):
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        for key, info in header.items():
            table = ngram_table_key(key) if key != "__metadata__" else None
            if table is None:
                continue
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            if len(shape) != 2:
                raise ModelLoadError(f"{key}: an n-gram table shard of shape {list(shape)}, expected [rows, dim]")
            found.setdefault(table[0], {})[table[1]] = (path, 8 + size + begin, shape, info["dtype"])  # type: ignore[assignment]
    out = {}
    for name, shards in found.items():
        idx = sorted(shards)
        if idx != [-1] and (idx != list(range(len(idx))) or len(idx) != spec.ple.split_parts):
            raise ModelLoadError(f"{name}: n-gram table shards {idx} do not make "
                                 f"split_ngram_parts={spec.ple.split_parts} parts")
        out[name] = MmapRows(name, [shards[i] for i in idx])
    return out


def table_keys(checkpoint_dir: str | Path, names: Mapping[str, Any]) -> set[str]:
    """The checkpoint keys holding the tables `names` (so the eager read can skip them)."""
    keys = set()
    for path in safetensor_files(checkpoint_dir):
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        keys.update(k for k in header if k != "__metadata__" and (t := ngram_table_key(k)) and t[0] in names)
    return keys


def row_sources(model: Any, itemsize: int, budget: int | str | None = None) -> dict[str, Any]:
    """The n-gram tables a backend serves through its row cache, by name (empty: every table whole): the tables
    the loader left in the checkpoint, or, for a model loaded whole, all of them when they take more than the
    budget at `itemsize` bytes an element."""
    if model.ngram_rows:
        return dict(model.ngram_rows)
    tables = {k: t for k, t in model.weights.items() if k.endswith(".ple.ngram_embedding.weight")}
    if sum(t.numel() for t in tables.values()) * itemsize <= ngram_budget(budget):
        return {}
    return {k: TensorRows(t) for k, t in tables.items()}
