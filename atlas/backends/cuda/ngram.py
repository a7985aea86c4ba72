"""The CUDA backend's n-gram row cache: the slots of every PLE layer one device tensor, filled from the host.

A table the backend does not hold whole (atlas.model.ngram_rows.row_sources: left in the checkpoint by the
loader, or over the n-gram budget) is replaced in the weights by its layer's slots [slots, dim], and each PLE
layer gets a device remap [table rows] int32 from a row to its slot. The groups compute their n-gram ids as
always (on the device, in the graphs; ple.ngram_ids_from then reads them through the remap), so nothing a
graph captures changes shape or address. Before a step's forward the host computes the same ids from each
sequence's context (the runner's _ngram_row_ids), assigns slots with atlas.model.ngram_cache.RowCache (the
bookkeeping the CPU backend's cache uses), gathers the missed rows from the memory-mapped checkpoint and copies
them, with the remap's changes, to the device in one transfer. Ids the host did not assign (a graph bucket's
padding rows) read whatever slot the remap names: always a valid row, and their outputs are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from atlas.errors import CapacityError
from atlas.model.ngram_cache import CacheStats, RowCache
from atlas.model.ngram_rows import row_sources


class DeviceNgramCache:
    """Row caches of the PLE layers' tables `names` (in PLE layer order), their slots and remaps on `device`."""

    def __init__(self, sources: dict[str, Any], names: Sequence[str], *, slots: int, scratch_rows: int, heads: int,
                 model_dtype: torch.dtype, dtype: torch.dtype, device: torch.device) -> None:
        self.names = list(names)
        self.sources = [sources[n] for n in self.names]
        self.caches = [RowCache(slots) for _ in self.names]
        self.slots, self.scratch_rows, self.heads = slots, scratch_rows, heads
        self.model_dtype, self.dtype, self.device = model_dtype, dtype, device
        dim = self.sources[0].shape[1]
        if any(s.shape[1] != dim for s in self.sources):
            raise ValueError("the PLE layers' n-gram tables differ in row width")
        self.dim = dim
        self.rows = torch.zeros((len(self.names), slots, dim), dtype=dtype, device=device)
        sizes = [s.shape[0] for s in self.sources]
        self.remap_at = np.cumsum([0, *sizes])[:-1].astype(np.int64)
        self.remap = torch.zeros(sum(sizes), dtype=torch.int32, device=device)
        # the staging buffer of one step's transfer: [int64 fill slots, remap positions, remap values | rows]; a
        # fill's remap changes are its row and at most one evicted row
        most = len(self.names) * scratch_rows * heads
        self._staging = torch.empty(most * (8 * 5 + dim * dtype.itemsize), dtype=torch.uint8,
                                    pin_memory=device.type == "cuda")
        self._copied: torch.cuda.Event | None = None
        self.transfers = 0

    def tables(self) -> dict[str, torch.Tensor]:
        """The weights entries that replace the tables: each layer's slots."""
        return {name: self.rows[p] for p, name in enumerate(self.names)}

    def remaps(self) -> list[torch.Tensor]:
        """Each PLE layer's remap [its table's rows] int32 (ple.ngram_ids_from's fourth table)."""
        return [self.remap[int(a) : int(a) + s.shape[0]] for a, s in zip(self.remap_at, self.sources, strict=True)]

    @property
    def stats(self) -> CacheStats:
        total = CacheStats()
        for c in self.caches:
            for field in ("lookups", "hits", "misses", "evictions"):
                setattr(total, field, getattr(total, field) + getattr(c.stats, field))
        return total

    def slot_ids(self, layer: int, rows: Sequence[int]) -> list[int]:
        """The slots of rows this step assigned (a row-by-row verify packs them instead of the ids)."""
        return self.caches[layer].lookup(np.asarray(rows, dtype=np.int64)).tolist()

    def fill(self, per_layer: Sequence[np.ndarray], tokens: int) -> None:
        """Make every row of `per_layer` (each PLE layer's ids of the step, any shape) resident, the step's misses
        and remap changes in one host-to-device copy. `tokens`: the step's tokens (at most ple_scratch_rows)."""
        if tokens > self.scratch_rows:
            raise CapacityError(f"PLE: {tokens} tokens exceed the {self.scratch_rows} this layer was sized for "
                                "(ple_scratch_rows; its floor is max_batch_tokens)")
        dest, pos, val, gathered = [], [], [], []
        for p, rows in enumerate(per_layer):
            got = self.caches[p].assign(rows)
            if not len(got.fill_rows):
                continue
            dest.append(got.fill_slots + p * self.slots)
            pos += [got.evicted + self.remap_at[p], got.fill_rows + self.remap_at[p]]
            val += [np.zeros_like(got.evicted), got.fill_slots]
            gathered.append(self.sources[p].gather(got.fill_rows).to(self.model_dtype).to(self.dtype))
        if not dest:
            return
        ints = np.concatenate([*dest, *pos, *val])
        rows = torch.cat(gathered)
        n_int, n_fill, n_pos = len(ints), sum(len(d) for d in dest), sum(len(q) for q in pos)
        size = n_int * 8 + rows.numel() * rows.element_size()
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the staging buffer
        host = self._staging[:size]
        host[: n_int * 8].view(torch.int64).copy_(torch.from_numpy(ints))
        host[n_int * 8 :].view(self.dtype).view(-1, self.dim).copy_(rows)
        dev = host.to(self.device, non_blocking=True)
        self.transfers += 1
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        ints_dev = dev[: n_int * 8].view(torch.int64)
        fill = ints_dev[:n_fill]
        self.rows.view(-1, self.dim).index_copy_(0, fill, dev[n_int * 8 :].view(self.dtype).view(-1, self.dim))
        self.remap.index_copy_(0, ints_dev[n_fill : n_fill + n_pos],
                               ints_dev[n_fill + n_pos :].to(torch.int32))


def device_ngram_cache(model: Any, *, dtype: torch.dtype, device: torch.device, slots: int, scratch_rows: int,
                       budget: int | str | None) -> DeviceNgramCache | None:
    """The backend's cache when some n-gram table is not held whole (None otherwise)."""
    spec = model.spec
    if spec.ple is None:
        return None
    sources = row_sources(model, dtype.itemsize, budget)
    if not sources:
        return None
    if slots < 1 or scratch_rows < 1:
        raise CapacityError("an n-gram table served through the row cache needs ngram_cache_slots and "
                            "ple_scratch_rows (build the backend with for_capacities)")
    names = [f"layers.{layer}.ple.ngram_embedding.weight" for layer in spec.ple.layers]
    return DeviceNgramCache(sources, names, slots=slots, scratch_rows=scratch_rows, heads=spec.ple.num_heads,
                            model_dtype=model.dtype, dtype=dtype, device=device)
