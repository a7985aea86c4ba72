"""`CudaStateStore`: the StateStore contract (atlas.backends.base) over the CUDA backend's device pools.

Per sequence the device holds: KV rows and QSA raw index keys, paged through its block table, each row with its
position stamp; the per-slot state (GDN conv + recurrent, PLE short conv and n-gram context) with a stamp per
state; the MTP drafter's rows (atlas.backends.cuda.drafter). The host keeps only bookkeeping: the slot, how many
tokens were fed (what the next chunk must start at), a mirror of the n-gram context (the host computes the n-gram
ids from it; state_digest checks it against the device's copy), which ring slot holds which position, and a
pending verify's shape. Every cursor the store reports is read from the stamps (`read_cursors`): one summary on
the device (atlas.backends.cuda.stamp_read) and one device->host copy for all the sequences asked about. The
snapshot ring and prefix snapshots are atlas.backends.cuda.snapshots' (a base of the store).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from atlas.backends.audit import StateAudit, feed
from atlas.backends.cuda.audit import slot_digest, verify_row_digests
from atlas.backends.cuda.batch import sentinel_slot, to_device
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.cuda.seq_state import PrefixEntry, SeqState
from atlas.backends.cuda.snapshots import Snapshots
from atlas.backends.cuda.stamp_read import StampReader
from atlas.errors import VerifyRefused
from atlas.model.spec import ModelSpec
from atlas.plan import BackendCursors


@attrs.define
class StampReads:
    """The cost of reading cursors from the stamps: calls, sequences, seconds (the benchmark prints them)."""

    calls: int = 0
    seqs: int = 0
    seconds: float = 0.0
    # of `seconds`, the fast read's summary launch (a graph replay), its copy and the synchronize (which also waits
    # for device work queued before the read): the rest is the host's Python
    device_seconds: float = 0.0
    # the reads started early (`prefetch`: a plain step's stamps are final once its forward is queued): the host's
    # launch work then overlaps the device's forward, and is counted here, not in `seconds`
    prefetch_seconds: float = 0.0


class CudaStateStore(Snapshots):
    def __init__(self, spec: ModelSpec, pools: DevicePools, *, slot_bytes: int = 0, drafter: Any = None,
                 table_blocks: int = 0, graphs: bool = False, audit: bool = False) -> None:
        """`slot_bytes`: Capacities.ring_slot_bytes, what one ring or prefix snapshot must hold (0: unchecked).
        `table_blocks`: the most blocks a sequence's table holds (the device tables' width; 0: every block);
        `graphs`: the stamp read replayed from CUDA graphs. `audit`: the state-digest audit mode (atlas.backends.audit:
        snapshots record the slot state's digest, restores check it, verify commits check the installed row)."""
        self.audit = StateAudit() if audit else None
        self.spec, self.pools = spec, pools
        self.block_size = pools.block_size
        self.verify_width = pools.verify_width
        self.drafter = drafter
        held = pools.slot_bytes()
        if slot_bytes and held != slot_bytes:  # the derived size and what is stored must agree
            raise ValueError(f"a CUDA ring slot holds {held} bytes; ring_slot_bytes is {slot_bytes} "
                             "(derive_capacities and the backend's pools disagree)")
        self.seqs: dict[int, SeqState] = {}
        self.prefix: dict[int, PrefixEntry] = {}
        self.reads = StampReads()
        self._launched: tuple[tuple[int, ...], Any] | None = None  # a prefetched read: (seq ids, what it launched)
        self.reader = StampReader(pools, drafter, table_blocks=table_blocks or pools.num_kv_blocks, graphs=graphs)
        self.prompt_tail: dict[int, torch.Tensor] = {}  # prompt logprobs: the logits the next chunk's first token needs
        self.pending_hidden: dict[int, torch.Tensor] = {}  # a pending verify's target hidden per row [K, H]

    # -- lifecycle ------------------------------------------------------------------------------------

    def held(self, seq_id: int) -> int:
        s = self.seqs.get(seq_id)
        return 0 if s is None else s.position

    def reset(self, seq_id: int) -> None:
        self._launched = None  # a write: a prefetched read is stale
        s = self.seqs.get(seq_id)
        if s is None:
            s = self.seqs[seq_id] = SeqState(slot=self.pools.allocate())
        self.pools.clear(s.slot)
        # no block table: no KV row counts (its old blocks are the engine's again; the next chunk's writes clear
        # the stamp past their end)
        s.position, s.pending, s.ring, s.table = 0, None, {}, ()
        self._forget(seq_id)
        s.ple_context = [self.pools.ple_eos] * self.pools.ple_context_len
        self.prompt_tail.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.reset(seq_id, s.slot)

    def release(self, seq_id: int) -> None:
        self._launched = None  # a write: a prefetched read is stale
        s = self.seqs.pop(seq_id, None)
        self.prompt_tail.pop(seq_id, None)
        self._forget(seq_id)
        if s is not None:
            if self.drafter is not None:
                self.drafter.release(seq_id)
            self.pools.free(s.slot)

    def _clear_stamp(self, table: Sequence[int], position: int) -> None:
        flat = sentinel_slot(list(table), position, self.block_size, self.pools.scratch_block)
        self.pools.stamp_rows(torch.tensor([flat], device=self.pools.device),
                              torch.tensor([-1], dtype=torch.int32, device=self.pools.device))

    # -- cursors, read from the stamps ----------------------------------------------------------------

    def cursors(self, seq_id: int) -> BackendCursors:
        return self.read_cursors([seq_id])[seq_id]

    def _split(self, seq_ids: Sequence[int]) -> tuple[list[int], dict[int, BackendCursors]]:
        """The live sequences among `seq_ids` (once each, in order), and zero cursors for the ones not held."""
        live = list(dict.fromkeys(seq_ids))
        if all(map(self.seqs.__contains__, live)):  # every one held (a decode step's): C-level passes
            return live, {}
        live = [s for s in live if s in self.seqs]
        return live, {s: BackendCursors(kv_tokens=0, qsa_ingested=0, ssm_position=0, ple_position=0)
                      for s in seq_ids if s not in self.seqs}

    def prefetch(self, seq_ids: Sequence[int]) -> None:
        """Start the read of `seq_ids` now: the caller promises that nothing writes their state before it calls
        read_cursors(seq_ids) (a plain decode step once its forward is queued: no verify, snapshot or drafter
        after the sampler), so the summary's launch and copy overlap the device's forward and the read only waits
        for the copy. Any state write through the store in between drops the started read (read anew)."""
        live, _ = self._split(seq_ids)
        if live:
            self.prefetch_held(tuple(seq_ids), list(map(self.seqs.__getitem__, live)))
        else:
            self._launched = None

    def prefetch_held(self, key: tuple[int, ...], states: list[SeqState]) -> None:
        """`prefetch` of held sequences, each once, their SeqStates given (the steady decode step has them);
        `key`: the seq ids the read will ask for."""
        t0 = time.perf_counter()
        self._launched = (key, self.reader.launch(states))
        self.reads.prefetch_seconds += time.perf_counter() - t0

    def read_cursors(self, seq_ids: Sequence[int]) -> dict[int, BackendCursors]:
        """Every stamp of every sequence in `seq_ids` (atlas.backends.cuda.stamp_read: the device block tables,
        one summary, a graph replay on the GPU, one copy to the host); what read_cursors_reference reads."""
        live, out = self._split(seq_ids)
        if not live:
            self._launched = None
            return out
        states = list(map(self.seqs.__getitem__, live))
        out.update(zip(live, self.read_held(tuple(seq_ids), live, states), strict=True))
        return out

    def read_held(self, key: tuple[int, ...], live: Sequence[int], states: list[SeqState]) -> list[BackendCursors]:
        """read_cursors of held sequences `live`, each once, their SeqStates given: their cursors in order. `key`:
        the seq ids asked for (a read prefetched under that key is taken)."""
        launched, self._launched = self._launched, None
        t0 = time.perf_counter()
        held = list(map(self.drafter.seqs.__contains__, live)) if self.drafter is not None else [False] * len(live)
        started = launched[1] if launched is not None and launched[0] == key else None
        made = self.reader.read(states, held, started)
        self.reads.device_seconds = self.reader.device_seconds
        self.reads.calls += 1
        self.reads.seqs += len(live)
        self.reads.seconds += time.perf_counter() - t0
        return made

    def read_cursors_reference(self, seq_ids: Sequence[int]) -> dict[int, BackendCursors]:
        """The first stamp read, kept as the oracle of read_cursors (tests/test_cuda_stamps_read.py) and the
        benchmark's "before": every table built as host lists, copied, ~25 eager ops and a copy back."""
        live, out = self._split(seq_ids)
        if not live:
            return out
        t0 = time.perf_counter()
        pools, bs, dev = self.pools, self.block_size, self.pools.device
        states = [self.seqs[s] for s in live]
        width = max(1, max(len(s.table) for s in states))
        tables = torch.tensor([list(s.table) + [pools.scratch_block] * (width - len(s.table)) for s in states],
                              dtype=torch.long)
        lengths = torch.tensor([len(s.table) * bs for s in states], dtype=torch.long)
        tables, lengths = tables.to(dev, non_blocking=True), lengths.to(dev, non_blocking=True)
        span = width * bs
        parts: list[torch.Tensor] = []
        if pools.paged_kinds:
            flat = (tables[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(len(live), span)
            pos = pools.paged_pos.view(len(pools.paged_kinds), -1)[:, flat]  # [A, S, span]
            want = torch.arange(span, device=dev, dtype=torch.int32)
            match = (pos == want) & (want[None, :].to(torch.long) < lengths[:, None])[None]
            match = torch.cat([match, torch.zeros_like(match[..., :1])], dim=-1)
            parts.append((~match).to(torch.int8).argmax(dim=-1).to(torch.int32).flatten())  # leading run
        slots = torch.tensor([s.slot for s in states], device=dev)
        parts.append(pools.stamps[:, slots].flatten())
        if self.drafter is not None:
            parts.append(self.drafter.stamps(live))
        host = torch.cat(parts).tolist()  # the one device->host copy
        self.reads.calls += 1
        self.reads.seqs += len(live)
        self.reads.seconds += time.perf_counter() - t0
        n_paged, n_state = len(pools.paged_kinds), len(pools.names)
        paged = host[: n_paged * len(live)]
        slot_stamps = host[n_paged * len(live) : (n_paged + n_state) * len(live)]
        drafter = host[(n_paged + n_state) * len(live) :]
        for i, seq_id in enumerate(live):
            stamps = [(kind, layer, paged[a * len(live) + i]) for a, (kind, layer) in enumerate(pools.paged_kinds)]
            stamps += [(*pools.kinds[n], slot_stamps[j * len(live) + i]) for j, n in enumerate(pools.names)]
            if drafter:
                stamps.append(("drafter", -1, drafter[i]))
            out[seq_id] = _summary(tuple(stamps))
        return out

    # -- verify ---------------------------------------------------------------------------------------

    def check_commit(self, seq_id: int, rows: int) -> SeqState:
        s = self.seqs.get(seq_id)
        if s is None or s.pending is None:
            raise VerifyRefused(f"sequence {seq_id} has no pending verify to commit")
        start, tokens = s.pending
        k = len(tokens)
        if not 1 <= rows <= k:
            raise VerifyRefused(f"commit of {rows} rows of a verify of width {k}: at least the first position and at "
                                "most K are committed")
        if rows > self.verify_width:
            raise VerifyRefused(f"commit of {rows} rows needs {rows} per-token intermediates; the pool holds "
                                f"{self.verify_width} (verify_width). No state was changed")
        if s.position != start:
            raise VerifyRefused(f"the sequence moved to {s.position} since its verify at {start}")
        return s

    def commit(self, seq_id: int, rows: int) -> BackendCursors:
        """Keep the first `rows` rows of the pending verify, validated first."""
        self._launched = None  # a write: a prefetched read is stale
        self.commit_many([(seq_id, rows)])
        return self.cursors(seq_id)

    def commit_many(self, commits: Sequence[tuple[int, int]],
                    select: Callable[[list[int], list[int]], None] | None = None) -> None:
        """Commit several verifies at once: each slot's state selected from its kept row on the device (by
        `select(slots, rows)` where given: a verify's commit graph, else pools.inter_load), the kept rows' KV / QSA
        stamps turned from pending to their positions (the rest stay pending: not counted)."""
        self._launched = None  # a write: a prefetched read is stale
        states = [self.check_commit(seq_id, rows) for seq_id, rows in commits]  # refuse before anything moves
        if not commits:
            return
        dev = self.pools.device
        if select is not None:
            select([s.slot for s in states], [rows for _, rows in commits])
        else:
            slots = to_device([s.slot for s in states], dev)
            self.pools.inter_load(slots, to_device([rows for _, rows in commits], dev))
        flat: list[int] = []
        values: list[int] = []
        fed: list[tuple[int, int, tuple[int, ...], int]] = []
        kept: dict[int, torch.Tensor] = {}
        bs = self.block_size
        verified = {seq_id: self.audit.take_verify(seq_id) for seq_id, _ in commits} if self.audit is not None else {}
        for s, (seq_id, rows) in zip(states, commits, strict=True):
            if verified.get(seq_id) is not None:
                self.audit.check_commit(seq_id, rows, verified[seq_id], slot_digest(self.pools, s.slot))
            start, tokens = s.pending  # type: ignore[misc]
            for p in range(start, start + rows):
                flat.append(s.table[p // bs] * bs + p % bs)
                values.append(p)
            s.position = start + rows
            s.pending = None
            hidden = self.pending_hidden.pop(seq_id, None)
            if self.drafter is not None and hidden is not None:  # the drafter's keys rebuilt from the target's hidden
                fed.append((seq_id, start, tuple(tokens[:rows]), 0))
                kept[seq_id] = hidden[:rows]
            if self.pools.ple_context_len:
                s.ple_context = (s.ple_context + list(tokens[:rows]))[-self.pools.ple_context_len :]
        self.pools.stamp_rows(to_device(flat, dev), to_device(values, dev, torch.int32))
        self.pools.kept.clear()
        if fed:
            for seq_id in kept if self.audit is not None else ():  # the pair keys' hidden is the verify's
                self.audit.check_hidden(seq_id, kept[seq_id].shape[0], verified.get(seq_id), kept[seq_id])
            self.drafter.feed(fed, kept)  # type: ignore[union-attr]

    def drop_pending(self, seq_id: int) -> None:
        self._launched = None  # a write: a prefetched read is stale
        s = self.seqs.get(seq_id)
        self._forget(seq_id)
        if s is not None:
            s.pending = None

    def _forget(self, seq_id: int) -> None:
        self.pending_hidden.pop(seq_id, None)
        if self.audit is not None:
            self.audit.forget(seq_id)

    def record_verify(self, seq_id: int, hidden: torch.Tensor) -> None:
        """A verify's rows ran (atlas.backends.cuda.verify): the target's hidden per row waits for the commit (the
        drafter's pair keys); the audit records what each row's commit must install and that hidden."""
        self.pending_hidden[seq_id] = hidden
        if self.audit is not None:
            s = self.seqs[seq_id]
            rows = verify_row_digests(self.pools, s.slot, len(s.pending[1]))  # type: ignore[index]
            self.audit.record_verify(seq_id, rows, hidden if self.drafter is not None else None)

    # -- audit ----------------------------------------------------------------------------------------

    def state_digest(self, seq_id: int, *, drafter: bool = True) -> str:
        """BLAKE2b over every state byte the sequence holds up to its position: KV rows and QSA keys of positions
        0 .. position - 1 through its block table, every per-slot state (GDN conv + recurrent, PLE short conv and
        n-gram context), and the drafter's rows unless `drafter` is False."""
        s = self.seqs.get(seq_id)
        if s is None:
            return "absent"
        pools = self.pools
        cur = self.cursors(seq_id)
        h = hashlib.blake2b(digest_size=16, person=b"atlas.state")
        h.update(f"{cur.kv_tokens}:{cur.qsa_ingested}:{cur.ssm_position}:{cur.ple_position}".encode())
        if s.position:
            bs = self.block_size
            slots = torch.tensor([s.table[p // bs] * bs + p % bs for p in range(s.position)], device=pools.device)
            for layer in sorted(pools.keys):
                feed(h, f"k{layer}", pools.keys[layer].view(-1, *pools.keys[layer].shape[2:])[slots])
                feed(h, f"v{layer}", pools.values[layer].view(-1, *pools.values[layer].shape[2:])[slots])
            for layer in sorted(pools.index_keys):
                feed(h, f"q{layer}", pools.index_keys[layer].view(-1, pools.index_keys[layer].shape[-1])[slots])
        for name in pools.names:
            feed(h, name, pools.state[name][s.slot])
        if pools.ple_context_len:
            device_ctx = pools.state["pctx"][s.slot].tolist()
            if device_ctx != s.ple_context:  # the host computes n-gram ids from its mirror: they must agree
                raise RuntimeError(f"sequence {seq_id}: the host's n-gram context {s.ple_context} is not the "
                                   f"device's {device_ctx}")
        if drafter and self.drafter is not None:
            self.drafter.digest(h, seq_id)
        return h.hexdigest()


def _summary(stamps: tuple[tuple[str, int, int], ...]) -> BackendCursors:
    """The summary cursors: the minimum over each kind's stamps (QSA keys, SSM and PLE fall back to the KV count
    for a model without those layers)."""
    def least(*kinds: str) -> int | None:
        got = [p for k, _, p in stamps if k in kinds]
        return min(got) if got else None

    kv = least("kv")
    kv = 0 if kv is None else kv
    qsa, ssm, ple, drafter = least("qsa"), least("conv", "gdn"), least("ple", "ple_conv"), least("drafter")
    return BackendCursors(kv_tokens=kv, qsa_ingested=kv if qsa is None else qsa,
                          ssm_position=kv if ssm is None else ssm, ple_position=kv if ple is None else ple,
                          drafter_rows=0 if drafter is None else drafter, stamps=stamps)
