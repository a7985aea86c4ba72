"""`CpuStateStore`: the CPU reference's implementation of the StateStore contract (atlas.backends.base).

Per sequence: an immutable-per-chunk SequenceState (GDN conv + recurrent, PLE context + short conv, QSA raw
keys; KV rows live in the shared paged pool), the MTP drafter's rows (DrafterState), and a pending verify's
per-row states until its commit. A ring snapshot and a prefix snapshot are deep copies of the non-positional
state (KV, QSA keys and drafter rows are positional: a restore rewinds their cursors and the positions past
it are dropped, or, for a prefix snapshot, the partial block's KV rows and the keys travel with it).
"""

from __future__ import annotations

import copy

import attrs
import torch
from atlas_kernels.rows import RowOffset

from atlas.backends.audit import StateAudit
from atlas.backends.cpu.digest import sequence_digest, snapshot_digest
from atlas.backends.cpu.drafter import DrafterState, MtpDrafter
from atlas.backends.cpu.prefix_store import PrefixEntry, PrefixStore
from atlas.backends.cpu.ring import SnapshotRing
from atlas.backends.cpu.state import KvPool, SequenceState, StateSnapshot
from atlas.backends.cpu.verify import PendingVerify, check_commit
from atlas.errors import RestoreRefused, VerifyRefused
from atlas.model.spec import ModelSpec
from atlas.plan import BackendCursors, CarryOrder, PrefixRestore, RingRestore, RingSnapshot
from atlas.plan import PrefixStore as PrefixStoreOrder


class CpuStateStore:
    def __init__(self, spec: ModelSpec, kv: KvPool, dtype: torch.dtype, *, ring_slots: int, verify_width: int,
                 drafter: MtpDrafter | None, slot_bytes: int = 0, audit: bool = False) -> None:
        """`slot_bytes`: Capacities.ring_slot_bytes, what one ring or prefix snapshot must hold (0: unchecked).
        `audit`: the state-digest audit mode: every ring and prefix snapshot records a digest of the bytes it
        saved, a restore checks the restored bytes against it, and a verify commit checks the installed state
        against the row the verify computed (StateDigestMismatch; atlas.backends.audit, shared with CUDA)."""
        self.spec = spec
        self.slot_bytes = slot_bytes
        self.audit = StateAudit() if audit else None
        self.kv = kv
        self.dtype = dtype
        self.block_size = kv.block_size
        self.verify_width = verify_width
        self.drafter = drafter
        self.seqs: dict[int, SequenceState] = {}
        self.drafts: dict[int, DrafterState] = {}
        self.pending: dict[int, PendingVerify] = {}
        self.tables: dict[int, tuple[int, ...]] = {}  # each sequence's last block table (snapshots copy tail rows)
        self.ring = SnapshotRing(ring_slots)
        self.prefix = PrefixStore()
        # prompt logprobs: the last row's logits of a prompt chunk the next chunk continues (they score its first
        # token)
        self.prompt_tail: dict[int, torch.Tensor] = {}

    # -- lifecycle ------------------------------------------------------------------------------------

    def reset(self, seq_id: int) -> None:
        self.seqs[seq_id] = SequenceState.empty(self.spec, self.dtype)
        self.ring.release(seq_id)
        self.pending.pop(seq_id, None)
        self._forget(seq_id)
        self.prompt_tail.pop(seq_id, None)
        if self.drafter is not None:
            self.drafts[seq_id] = self.drafter.empty()

    def release(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self.ring.release(seq_id)
        self.pending.pop(seq_id, None)
        self._forget(seq_id)
        self.drafts.pop(seq_id, None)
        self.tables.pop(seq_id, None)
        self.prompt_tail.pop(seq_id, None)

    def cursors(self, seq_id: int) -> BackendCursors:
        """Every per-layer state's position, measured: KV rows from the pool's position stamps through the
        sequence's block table, QSA keys from the rows held, recurrent and PLE state from the stamps their own
        computation returned (BackendCursors.stamps)."""
        s = self.seqs.get(seq_id)
        if s is None:
            return BackendCursors(kv_tokens=0, qsa_ingested=0, ssm_position=0, ple_position=0)
        d = self.drafts.get(seq_id)
        table = self.tables.get(seq_id, ())
        stamps = [("kv", layer, self.kv.stamped(layer, table, s.kv_tokens)) for layer in sorted(self.kv.keys)]
        stamps += [("qsa", layer, int(keys.shape[0])) for layer, keys in sorted(s.qsa_keys.items())]
        stamps += [(kind, layer, at) for (kind, layer), at in sorted(s.stamps.items())]
        if d is not None:
            stamps.append(("drafter", -1, d.rows))

        def least(*kinds: str) -> int:
            return min((at for kind, _, at in stamps if kind in kinds), default=s.kv_tokens)

        return BackendCursors(kv_tokens=least("kv"), qsa_ingested=least("qsa", "kv"), ssm_position=least("conv", "gdn"),
                              ple_position=least("ple", "ple_conv"), drafter_rows=0 if d is None else d.rows,
                              stamps=tuple(stamps))

    def held(self, seq_id: int) -> int:
        s = self.seqs.get(seq_id)
        return 0 if s is None else s.kv_tokens

    # -- the snapshot ring ----------------------------------------------------------------------------

    def copy_state(self, seq_id: int) -> StateSnapshot:
        """Deep copy of the sequence's non-KV state at its current position."""
        s = self.seqs[seq_id]
        snap = StateSnapshot(position=s.kv_tokens, gdn_conv=copy.deepcopy(s.gdn_conv),
                             gdn_recurrent=copy.deepcopy(s.gdn_recurrent),
                             ple_context=None if s.ple_context is None else s.ple_context.clone(),
                             ple_conv=copy.deepcopy(s.ple_conv), stamps=dict(s.stamps))
        held = snap.nbytes
        if self.slot_bytes and held != self.slot_bytes:  # the derived size and what is stored must agree
            raise RestoreRefused(f"a snapshot of sequence {seq_id} holds {held} bytes; ring_slot_bytes is "
                                 f"{self.slot_bytes} (derive_capacities and the backend's state disagree)")
        return snap

    def snapshot(self, order: RingSnapshot) -> None:
        self.ring.check_store(order.seq_id, order.slot)
        s = self.seqs.get(order.seq_id)
        if s is None or s.kv_tokens != order.position or order.seq_id in self.pending:
            raise RestoreRefused(f"sequence {order.seq_id}: a ring snapshot at {order.position} needs the sequence "
                                 f"there, committed (holds {None if s is None else s.kv_tokens})")
        snap = self.copy_state(order.seq_id)
        self.ring.store(order.seq_id, order.slot, snap)
        if self.audit is not None:
            self.audit.record(("ring", order.seq_id, order.slot), snapshot_digest(snap))

    def restore(self, order: RingRestore) -> BackendCursors:
        seq_id, position = order.seq_id, order.position
        if seq_id not in self.seqs:
            raise RestoreRefused(f"sequence {seq_id} is not held by this backend")
        snap = self.ring.get(seq_id, order.slot, position)
        if position > self.seqs[seq_id].kv_tokens:
            raise RestoreRefused(f"sequence {seq_id}: snapshot at {position} is past the "
                                 f"{self.seqs[seq_id].kv_tokens} tokens held")
        self.rewind(seq_id, snap)
        self.ring.truncate_after(seq_id, position)
        if self.audit is not None:
            self.audit.check(seq_id, "ring restore", ("ring", seq_id, order.slot), snapshot_digest(self.seqs[seq_id]))
        return self.cursors(seq_id)

    def _forget(self, seq_id: int) -> None:
        if self.audit is not None:
            self.audit.forget(seq_id)

    def rewind(self, seq_id: int, snap: StateSnapshot) -> None:
        """Every cursor to `snap.position`, the non-positional state from the snapshot, together."""
        s = self.seqs[seq_id]
        if snap.position > s.kv_tokens:
            raise RestoreRefused(f"cannot restore to position {snap.position}: sequence {seq_id} holds {s.kv_tokens}")
        self.seqs[seq_id] = SequenceState(
            kv_tokens=snap.position, ssm_position=snap.position, ple_position=snap.position,
            qsa_keys={layer: keys[: snap.position].clone() for layer, keys in s.qsa_keys.items()},
            gdn_conv=copy.deepcopy(snap.gdn_conv), gdn_recurrent=copy.deepcopy(snap.gdn_recurrent),
            ple_context=None if snap.ple_context is None else snap.ple_context.clone(),
            ple_conv=copy.deepcopy(snap.ple_conv), stamps=dict(snap.stamps))
        self.pending.pop(seq_id, None)
        self._forget(seq_id)
        if seq_id in self.drafts:  # drafter rows rewind with every other cursor
            self.drafter.rewind(self.drafts[seq_id], snap.position)  # type: ignore[union-attr]

    # -- verify ---------------------------------------------------------------------------------------

    def commit(self, seq_id: int, rows: int) -> BackendCursors:
        """Keep the first `rows` rows of the pending verify, validated against every layer first."""
        pending = self.pending.get(seq_id)
        if pending is None or seq_id not in self.seqs:
            raise VerifyRefused(f"sequence {seq_id} has no pending verify to commit")
        check_commit(self.spec, self.seqs[seq_id], pending, rows, self.verify_width)
        verified = self.audit.take_verify(seq_id) if self.audit is not None else None
        del self.pending[seq_id]
        self.seqs[seq_id] = pending.states[rows - 1]
        if verified is not None:
            self.audit.check_commit(seq_id, rows, verified, snapshot_digest(self.seqs[seq_id]))
        if seq_id in self.drafts:
            d = self.drafts[seq_id]
            self.drafter.append(d, pending.start, pending.tokens[:rows], pending.hidden[:rows],  # type: ignore[union-attr]
                                then=pending.then)
            if verified is not None:  # the committed pair keys are built from the target's hidden the verify computed
                built = torch.stack(d.target_hidden[pending.start:pending.start + rows])  # type: ignore[arg-type]
                self.audit.check_hidden(seq_id, rows, verified, built)
        return self.cursors(seq_id)

    def draft_after(self, seq_id: int, token: int) -> None:
        """The pending verify's commit will be followed by a proposal after `token`: the drafter builds the
        first draft's row in the pass that appends the committed keys."""
        self.pending[seq_id] = attrs.evolve(self.pending[seq_id], then=token)

    def record_verify(self, seq_id: int, pending: PendingVerify) -> None:
        """A verify ran: it waits for `commit`; the audit keeps what it computed (each row's state digest and
        the target's hidden) apart from the pending object, so a commit that installs anything else is seen."""
        self.pending[seq_id] = pending
        if self.audit is not None:
            self.audit.record_verify(seq_id, tuple(snapshot_digest(s) for s in pending.states), pending.hidden)

    # -- prefix caching -------------------------------------------------------------------------------

    def store_prefix(self, order: PrefixStoreOrder) -> None:
        seq_id, position = order.seq_id, order.position
        s = self.seqs.get(seq_id)
        if s is None or s.kv_tokens != position or seq_id in self.pending:
            raise RestoreRefused(f"sequence {seq_id}: a prefix snapshot at {position} needs the sequence at exactly "
                                 f"that position, committed (holds {None if s is None else s.kv_tokens})")
        bs = self.block_size
        tail_keys: dict[int, torch.Tensor] = {}
        tail_values: dict[int, torch.Tensor] = {}
        if position % bs:
            slots = self.kv.slots(self.tables[seq_id], RowOffset(position - position % bs), position)
            for layer in self.kv.keys:
                k, v = self.kv.read(layer, slots)
                tail_keys[layer], tail_values[layer] = k.clone(), v.clone()
        d = self.drafts.get(seq_id)
        hidden = d.target_hidden[position - 1] if d is not None else None
        entry = PrefixEntry(self.copy_state(seq_id), {layer: keys[:position].clone() for layer, keys in s.qsa_keys.items()},
                            tail_keys, tail_values, hidden)
        self.prefix.store(order.key, entry, order.evicted)
        if self.audit is not None:
            self.audit.record(("prefix", order.key, 0), snapshot_digest(entry.state))

    def load_prefix(self, order: PrefixRestore) -> None:
        """Start the sequence at `position` from prefix snapshot `key`: the shared blocks of the block table
        hold the KV of the full blocks already; the snapshot's tail rows go into the block `position` ends in."""
        seq_id, position, table = order.seq_id, order.position, tuple(order.block_table)
        entry = self.prefix.get(order.key, position)
        if order.adopt and (self.prefix.carry is None or self.drafter is None):
            raise RestoreRefused(f"sequence {seq_id}: adoption of a drafter carry this backend does not hold")
        snap = entry.state
        self.seqs[seq_id] = SequenceState(
            kv_tokens=position, ssm_position=position, ple_position=position,
            qsa_keys={layer: keys.clone() for layer, keys in entry.qsa_keys.items()},
            gdn_conv=copy.deepcopy(snap.gdn_conv), gdn_recurrent=copy.deepcopy(snap.gdn_recurrent),
            ple_context=None if snap.ple_context is None else snap.ple_context.clone(),
            ple_conv=copy.deepcopy(snap.ple_conv), stamps=dict(snap.stamps))
        if entry.tail_keys:
            first = RowOffset(position - position % self.block_size)
            slots = self.kv.slots(table, first, position)
            for layer in self.kv.keys:
                self.kv.write(layer, slots, entry.tail_keys[layer], entry.tail_values[layer],
                              torch.arange(first, position))
        self.tables[seq_id] = table
        self.ring.release(seq_id)
        self.pending.pop(seq_id, None)
        self._forget(seq_id)
        if self.audit is not None:
            self.audit.check(seq_id, "prefix restore", ("prefix", order.key, 0), snapshot_digest(self.seqs[seq_id]))
        if self.drafter is not None:
            if order.adopt:
                self.drafts[seq_id] = self.drafter.adopt(self.prefix.carry, order.drafter_last_key,  # type: ignore[arg-type]
                                                         position, entry.last_hidden)
                self.prefix.carry = None
            else:
                self.drafts[seq_id] = self.drafter.resumed(order.drafter_first_key, position, entry.last_hidden)

    def carry(self, order: CarryOrder) -> None:
        if order.drop:
            self.prefix.carry = None
        if order.store >= 0:
            self.prefix.carry = self.drafts.get(order.store)

    # -- audit ----------------------------------------------------------------------------------------

    def state_digest(self, seq_id: int, *, drafter: bool = True) -> str:
        return sequence_digest(self, seq_id, drafter=drafter)
