"""The per-step stamp read, cheap: every stamp of every live sequence in one device computation and one copy.

What it reads is exactly what `CudaStateStore.read_cursors_reference` reads (the test oracle,
tests/test_cuda_stamps_read.py): per paged kind (kv, qsa per attention layer) the leading run of positions
0, 1, ... that the sequence's block table holds with their own position stamped, bounded by the table's length;
every per-slot stamp (GDN conv + recurrent, PLE conv + context); the drafter's leading run of rows holding their
own index. What changed is how:

- the block tables live on the device, one row per state slot (`tables`, column 0 the table's length in
  positions), updated only where a sequence's table changed since the last read (a few (cell, value) entries:
  a decode appends a block once every block_size steps), so no per-step list -> tensor building;
- the whole summary is one function over state slots [0, hi) and table columns [0, width) (the asked slots'
  bucketed bounds), a fixed shape, so on the GPU it is one CUDA graph replay per (hi, width) bucket; the
  table update entries ride in as the graph's static input (one small host->device copy, skipped when none);
- one device->host copy of an [hi, stamps] int32 matrix (into a pinned buffer on a CUDA device); a row whose
  stamps are all one position (every healthy sequence: the device's least and greatest stamp agree) takes the
  BackendCursors already built for that (position, drafter rows), found for the whole batch by one map over
  int keys, equal in value to a fresh build; only the other rows are built stamp by stamp (precomputed columns,
  tuple(zip(...)) and min over index lists). A shared BackendCursors computes its `uniform()` marker from its
  stamps once, when it is built, so the engine's cursor_violation checks every healthy sequence that shares it
  with three comparisons instead of a walk over its ~51 stamps (the walk stays for any that disagree).

The old read (before issue 13's follow-up) built every table as Python lists each step, copied them to the
device and ran ~25 eager ops: 0.5-1.1 ms a step on the H200 (6.3% of a batch-64 decode step).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import attrs
import numpy as np
import torch

from atlas.backends.cuda.graphs import bucket
from atlas.backends.cuda.pools import DevicePools
from atlas.plan import BackendCursors

ENTRIES = 64  # table-cell updates a graph replay applies itself; a read with more applies them eagerly first
_SLOT, _TABLE = attrgetter("slot"), attrgetter("table")
# asked rows from which a read's common case goes by numpy columns (below, the row loop costs less than numpy's
# per-call overhead: measured crossover ~16 rows on this box's CPU)
COLUMNS_FROM = 16
UNIFORM_CACHE = 4096  # (position, drafter rows) -> the shared BackendCursors of a healthy sequence there (~4 KB each)


@attrs.define
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    out: torch.Tensor  # static output [hi, columns] int32


class StampReader:
    def __init__(self, pools: DevicePools, drafter: Any, *, table_blocks: int, graphs: bool,
                 kernel: bool | None = None) -> None:
        """`table_blocks`: the most blocks a sequence's table holds (kv_blocks_per_seq; a longer table grows
        the device tables). `graphs`: replay the summary from CUDA graphs (a CUDA device). `kernel`: the summary as
        one Triton kernel (atlas_kernels.stamp_summary) instead of ~20 torch ops; default: on a CUDA device
        where atlas_kernels imports (on a CPU only under TRITON_INTERPRET=1, tests)."""
        self.pools, self.drafter = pools, drafter
        self.on_cuda = pools.device.type == "cuda"  # (torch.device.type builds a string each time: ~3 k instructions)
        self.use_graphs = graphs and self.on_cuda
        self.kernel = summary_kernel() if (pools.device.type == "cuda" if kernel is None else kernel) else None
        dev, slots = pools.device, pools.state_slots
        self.bs = pools.block_size
        self._alloc(max(1, table_blocks))
        self.synced: list[tuple[int, ...]] = [()] * slots  # the table each slot's device row holds
        # the last launch's (slots, widest table, slot bound, slots as an index array), while its tables stay synced
        self._last: tuple[list[int], int, int, np.ndarray] | None = None
        # the update entries (flat cell of `tables`, value): static, so a graph reads them; the dummy writes 0 into
        # the length cell of the last scratch slot (never a sequence's)
        self.dummy = (slots - 1) * (self.cols + 1)
        self.delta = torch.tensor([[self.dummy, 0]] * ENTRIES, dtype=torch.long, device=dev)
        self.delta_dummy = True  # the device delta holds only no-op entries
        self._delta_host: torch.Tensor | None = None  # _apply's staging buffer
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # the columns of a slot's row: paged kinds, per-slot states, the drafter; and which the summary takes
        self.kinds = tuple(k for k, _ in pools.paged_kinds) + tuple(pools.kinds[n][0] for n in pools.names)
        self.layers = tuple(layer for _, layer in pools.paged_kinds) + tuple(pools.kinds[n][1] for n in pools.names)
        if drafter is not None:
            self.kinds, self.layers = (*self.kinds, "drafter"), (*self.layers, -1)
        self.groups = {g: [i for i, k in enumerate(self.kinds) if k in ks] for g, ks in
                       (("kv", ("kv",)), ("qsa", ("qsa",)), ("ssm", ("conv", "gdn")), ("ple", ("ple", "ple_conv")),
                        ("drafter", ("drafter",)))}
        self._want = torch.arange(max(self.cols * self.bs, drafter.capacity if drafter else 1), dtype=torch.int32,
                                  device=dev)
        # constants of the summary made once, not a kernel of every replay: a block's offsets, `want` as int64
        self._offs = torch.arange(self.bs, device=dev)
        self._want_long = self._want.to(torch.long)
        self._uniform: dict[int, BackendCursors] = {}  # position << 32 | drafter rows -> a healthy row's cursors
        self.columns_from = COLUMNS_FROM
        self.device_seconds = 0.0  # in the summary's launch, its copy and the synchronize (StampReads.device_seconds)
        # a CUDA device: the host buffer of each summary shape and its numpy view; else the last summary and its view
        self._pinned: dict[torch.Size, tuple[torch.Tensor, np.ndarray]] = {}
        self._out_host: tuple[torch.Tensor | None, np.ndarray | None] = (None, None)

    def _alloc(self, cols: int) -> None:
        self.cols = cols
        # [slot, 1 + cols]: column 0 the table's length in positions, then its blocks (scratch block past it)
        self.tables = torch.full((self.pools.state_slots, 1 + cols), self.pools.scratch_block, dtype=torch.long,
                                 device=self.pools.device)
        self.tables[:, 0] = 0

    def close(self) -> None:
        """Drop the captured graphs (and so their memory pool)."""
        self._graphs.clear()

    # -- the device tables --------------------------------------------------------------------------

    def _entries(self, states: Sequence[Any], asked: Sequence[Any] | None = None) -> list[tuple[int, int]]:
        """(flat cell, value) of every table cell of `states` that changed since the last read, the synced record
        moved. `asked`: every state the read asks about (after a grow every device row is re-sent: all of them)."""
        out: list[tuple[int, int]] = []
        width = self.cols + 1
        for s in states:
            old, new = self.synced[s.slot], s.table
            if old is new or old == new:
                continue
            if len(new) > self.cols:
                self._grow(len(new))
                return self._entries(asked if asked is not None else states)
            same = len(old) if len(old) <= len(new) and new[: len(old)] == old else 0  # a decode appends a block
            base = s.slot * width
            if len(old) != len(new):
                out.append((base, len(new) * self.bs))
            out.extend((base + 1 + c, new[c]) for c in range(same, len(new)))
            self.synced[s.slot] = new
        return out

    def _grow(self, cols: int) -> None:
        """A table longer than the device rows: wider rows, every slot re-sent, the graphs recaptured."""
        self._alloc(bucket(cols))
        self.synced = [()] * self.pools.state_slots
        self.dummy = (self.pools.state_slots - 1) * (self.cols + 1)
        self._set_delta([])
        self._graphs.clear()
        self._last = None
        self._want = torch.arange(max(self.cols * self.bs, self._want.numel()), dtype=torch.int32,
                                  device=self.pools.device)
        self._want_long = self._want.to(torch.long)

    def _apply(self, entries: list[tuple[int, int]]) -> None:
        """The entries into the device tables. Graphs: up to ENTRIES as the static delta the replay applies (the
        delta left from an earlier read agrees with every cell it names, so re-applying it is harmless and a read
        with nothing new copies nothing); more, or eager: applied now, and the graph's delta made a no-op."""
        if not entries:
            return
        if self.use_graphs and len(entries) <= ENTRIES:
            self._set_delta(entries)
            return
        # through pinned memory, queued: a pageable copy (copy_ without non_blocking) waits for the whole stream, and
        # a fresh prompt's read comes right after its prefill is queued (H200: a 2,048-token prefill's 128 new blocks
        # take this path, and a pageable copy keeps the host here for the whole 20 ms graph before it can queue the
        # sampler and the summary behind it). Pinned blocks freed after a queued copy are not reused before it ends.
        e = torch.tensor(entries, dtype=torch.long)
        pinned = self.pools.device.type == "cuda"
        e = (e.pin_memory() if pinned else e).to(self.pools.device, non_blocking=pinned)
        self.tables.view(-1).index_copy_(0, e[:, 0], e[:, 1])
        if self.use_graphs and not self.delta_dummy:  # a stale entry must not overwrite what was just written
            self._set_delta([])

    def _set_delta(self, entries: list[tuple[int, int]]) -> None:
        """The graph's static delta: `entries` (at most ENTRIES), the rest no-op entries, queued from one host staging
        buffer (pinned on a CUDA device) refilled in place: the copy out of it is complete before the next read
        refills it (every read synchronizes on its summary's copy back). Within one read a second fill (a grow's
        no-op delta, then the read's own) may overtake the first copy: both then carry the last fill, the one wanted."""
        pinned = self.pools.device.type == "cuda"
        if self._delta_host is None:
            self._delta_host = torch.empty((ENTRIES, 2), dtype=torch.long, pin_memory=pinned)
        buf = self._delta_host.numpy()
        if entries:
            buf[: len(entries)] = entries
        buf[len(entries) :] = (self.dummy, 0)
        self.delta.copy_(self._delta_host, non_blocking=pinned)
        self.delta_dummy = not entries

    # -- the summary ----------------------------------------------------------------------------------

    def _summary(self, hi: int, width: int, *, delta: bool) -> torch.Tensor:
        """[hi, columns + 2] int32: every stamp of state slots 0 .. hi - 1, then the least and the greatest stamp
        but the drafter's (what a graph captures, `delta` applied first)."""
        pools, bs = self.pools, self.bs
        if delta:
            self.tables.view(-1).index_copy_(0, self.delta[:, 0], self.delta[:, 1])
        if self.kernel is not None and (pools.paged_kinds or pools.names):  # one launch (the same layout)
            return self.kernel(self.tables, pools.paged_pos, pools.stamps,
                               self.drafter.pos if self.drafter is not None else None, hi=hi, width=width,
                               block_size=bs)
        parts: list[torch.Tensor] = []
        if pools.paged_kinds:
            span = width * bs
            rows = self.tables[:hi]
            flat = (rows[:, 1 : 1 + width, None] * bs + self._offs).reshape(hi, span)
            a = len(pools.paged_kinds)
            pos = pools.paged_pos.view(a, -1).index_select(1, flat.view(-1)).view(a, hi, span)
            want = self._want[:span]
            match = (pos == want) & (self._want_long[None, :span] < rows[:, :1])[None]
            parts.append(_leading_run(match))
        parts.append(pools.stamps[:, :hi])
        body = torch.cat(parts)
        parts = [body]
        if self.drafter is not None:
            rec = self.drafter.pos[:hi]
            match = rec == self._want[: rec.shape[1]]
            parts.append(_leading_run(match)[None])
        # two more columns: the least and greatest stamp but the drafter's (equal: a uniform row)
        if body.shape[0]:
            parts += [body.amin(dim=0, keepdim=True), body.amax(dim=0, keepdim=True)]
        else:  # no per-layer state at all (a model of MTP rows only): uniform
            parts += [body.new_zeros(2, hi)]
        return torch.cat(parts).T.contiguous()

    def _capture(self, key: tuple[int, int]) -> _Graph:
        dev = self.pools.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # warm-up off the capture (the allocator settles)
            for _ in range(2):
                self._summary(*key, delta=True)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._summary(*key, delta=True)
        self._graphs[key] = g = _Graph(graph, out)
        return g

    def launch(self, states: Sequence[Any]) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The summary of `states` started: the changed table cells applied, the graph replayed (or the summary
        computed), its device->host copy queued. Returns (slots, host buffer); the buffer holds the rows once the
        stream reaches the copy (`read` synchronizes first), and the slots as an index array."""
        # C-level passes: the slots, the tables, the widest; the states whose table changed since the last read
        # (compared as lists: each pair by identity, then by value, as `_entries` does)
        slots, tables = list(map(_SLOT, states)), list(map(_TABLE, states))
        olds = list(map(self.synced.__getitem__, slots))
        last = self._last
        if olds != tables:
            changed = [s for s, old, table in zip(states, olds, tables, strict=True) if old is not table and old != table]
            self._apply(self._entries(changed, states))
            last = None
        # the same slots as the last launch, none of whose tables changed since (only a launch moves `synced`): the
        # same widest table and bound (a steady decode's every launch)
        if last is not None and last[0] == slots:
            width, hi, index = last[1:]
        else:
            width, hi, index = max(1, max(map(len, tables))), max(slots) + 1, np.array(slots, dtype=np.intp)
            self._last = (slots, width, hi, index)
        t0 = time.perf_counter()
        if self.use_graphs:  # bucketed: a graph per (slots, width) bucket
            key = (min(bucket(hi), self.pools.state_slots), min(bucket(width, 4), self.cols))
            g = self._graphs.get(key) or self._capture(key)
            g.graph.replay()
            out = g.out
        else:
            out = self._summary(hi, width, delta=False)
        host = self._host(out)
        self.device_seconds += time.perf_counter() - t0
        return slots, host, index

    def read(self, states: Sequence[Any], drafter_held: Sequence[bool],
             launched: tuple[list[int], np.ndarray, np.ndarray] | None = None) -> list[BackendCursors]:
        """Each state's BackendCursors, from one device computation and one device->host copy. `states`: the
        store's SeqState of each live sequence asked about; `drafter_held`: whether the drafter holds it;
        `launched`: what `launch(states)` returned, when the summary was started earlier in the step (its state
        final by then)."""
        slots, host, index = launched if launched is not None else self.launch(states)
        t0 = time.perf_counter()
        if self.on_cuda:
            torch.cuda.current_stream(self.pools.device).synchronize()  # the copy has landed
        self.device_seconds += time.perf_counter() - t0
        # a healthy sequence's stamps are all one position (the drafter's its own): its cursors are built once per
        # (position, drafter rows) and shared (BackendCursors is immutable), under an int key (position << 32 |
        # drafter rows: a tuple key hashes at twice the cost); a row whose least and greatest stamp differ is built
        # stamp by stamp. The common read of many rows (every row uniform, its cursors already built: a steady
        # decode's) is a few numpy calls on the asked rows' tail columns and one map over their int keys; any other
        # read takes the row loop below (one tolist of the tail columns), which builds, caches and clears as it did
        dr = self.drafter is not None
        uniform = self._uniform
        if len(slots) >= self.columns_from:
            rows = host[index]
            least = rows[:, -2].astype(np.int64)
            uni = least == rows[:, -1]
            keys = least << 32
            if dr:
                held_rows = np.where(np.array(drafter_held, dtype=bool), rows[:, -3], 0).astype(np.int64)
                keys |= held_rows & 0xFFFFFFFF
            made = list(map(uniform.get, keys.tolist()))
            if uni.all() and all(made):  # (a BackendCursors is always true: only a missing one is not)
                return made
            # the rows not served (new positions: the batch's leaders; rows that are not uniform), in order, as the
            # loop below builds and caches them
            ds = held_rows.tolist() if dr else [0] * len(slots)
            for i, (cur, ok, key, d) in enumerate(zip(made, uni.tolist(), keys.tolist(), ds, strict=True)):
                if cur is None or not ok:
                    made[i] = self._cursor(host, slots[i], dr, d, key if ok else None)
            return made
        tails = host[:, -3:].tolist() if dr else host[:, -2:].tolist()  # per slot: [drafter,] least, greatest
        made = []
        for slot, held in zip(slots, drafter_held, strict=True):
            tail = tails[slot]
            a = tail[-2]
            d = tail[0] if dr and held else 0  # not held: no rows (the reference's -1 slot)
            made.append(self._cursor(host, slot, dr, d, (a << 32) | (d & 0xFFFFFFFF) if a == tail[-1] else None))
        return made

    def _cursor(self, host: np.ndarray, slot: int, dr: bool, d: int, key: int | None) -> BackendCursors:
        """One row's BackendCursors: a uniform row's (`key`: its position << 32 | drafter rows) from the cache or built
        and cached, any other row's built stamp by stamp (key None)."""
        if key is None:
            return self._build(host, slot, dr, d)
        uniform = self._uniform
        cur = uniform.get(key)
        if cur is None:
            cur = self._build(host, slot, dr, d)
            cur.uniform()  # computed from its stamps once, so the engine's check of every sharer is cheap
            if len(uniform) >= UNIFORM_CACHE:
                uniform.clear()
            uniform[key] = cur
        return cur

    def _build(self, host: np.ndarray, slot: int, dr: bool, d: int) -> BackendCursors:
        row = host[slot, :-2].tolist()
        if dr:
            row[-1] = d
        return self.cursors(row)

    def _host(self, out: torch.Tensor) -> np.ndarray:
        """`out` on the host. A CUDA device: into a pinned buffer of its shape (a pageable copy stages through a
        driver buffer), queued on the stream: `read` synchronizes before it looks. The caller copies the rows it
        keeps before the next read."""
        if not self.on_cuda:  # the summary's own tensor (a graph's static output is the same one every read)
            if self._out_host[0] is not out:
                self._out_host = (out, out.numpy())
            return self._out_host[1]
        held = self._pinned.get(out.shape)
        if held is None:
            if len(self._pinned) >= 64:
                self._pinned.clear()
            buf = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            held = self._pinned[out.shape] = (buf, buf.numpy())
        held[0].copy_(out, non_blocking=True)
        return held[1]

    def cursors(self, row: list[int]) -> BackendCursors:
        """One sequence's BackendCursors from its row (atlas.backends.cuda.store._summary's rules: QSA, SSM and
        PLE fall back to the KV count for a model without those layers)."""
        g = self.groups
        kv = min(map(row.__getitem__, g["kv"])) if g["kv"] else 0
        qsa = min(map(row.__getitem__, g["qsa"])) if g["qsa"] else kv
        ssm = min(map(row.__getitem__, g["ssm"])) if g["ssm"] else kv
        ple = min(map(row.__getitem__, g["ple"])) if g["ple"] else kv
        drafter = row[-1] if g["drafter"] else 0
        return BackendCursors(kv_tokens=kv, qsa_ingested=qsa, ssm_position=ssm, ple_position=ple,
                              drafter_rows=drafter, stamps=tuple(zip(self.kinds, self.layers, row, strict=True)))


def summary_kernel() -> Any:
    """atlas_kernels.stamp_summary.stamp_summary, or None where the kernels do not import."""
    try:
        from atlas_kernels.stamp_summary import stamp_summary
    except ImportError:
        return None
    return stamp_summary


def _leading_run(match: torch.Tensor) -> torch.Tensor:
    """int32 [...]: how many leading entries of each last-dim row are True (argmin takes the first minimum, the first
    False; a row all True has none, so its length; a cumprod is 30x slower on a CPU)."""
    run = match.to(torch.uint8).argmin(dim=-1)
    return torch.where(match.all(dim=-1), match.shape[-1], run).to(torch.int32)
