"""Device-resident data-plane state: paged KV and QSA index keys, slot-indexed GDN and PLE state, and the
position stamps written with each of them.

Attention layers page their KV (and QSA raw index keys) through the block tables the engine hands out,
as the CPU backend does; everything a sequence carries that is not positional (GDN conv + recurrent
state, PLE short-conv state and n-gram context) lives in per-slot pools indexed by the sequence's state slot
(`state`, by name). One extra KV block and `scratch_slots` extra state slots take the writes of a CUDA graph's
padding rows.

Stamps (issue 13): each paged pool has an int32 position tensor beside it ([blocks + 1, block_size], -1 when
the row holds nothing of the sequence reading it) written by the same index_copy that writes the rows; each
per-slot state has an int32 stamp per slot, the number of tokens folded into it, written in the same graph
that updates the state and moved with it by snapshot, restore, commit and prefix load. A verify writes its KV
stamps as -(position + 2) (pending: not counted) and the commit turns the kept rows' stamps positive.

A verify of width K keeps the per-slot state after each of its rows until the commit selects one: a row-by-row
verify copies it into `inter[name]` [K + 1, slots, ...] (index 0: before the verify); a wide verify keeps the
forward's own per-token tensors (`kept`: no copy, they are read once by the commit). The ring holds
`ring[name]` [max_seqs, ring_slots, ...] per live slot.
"""

from __future__ import annotations

import torch

from atlas.errors import SlotsExhausted
from atlas.model.spec import ModelSpec


def store_final(dest: torch.Tensor, slots: torch.Tensor, final: torch.Tensor) -> None:
    """A group's new per-slot state `final` [B, ...] into `dest` at `slots` (the data half of DevicePools.put; a
    compiled region calls it on the pool it was handed, Inductor fusing it with the state's computation). A dense
    copy then index_copy_: index_put of the strided tail (the conv's last S of S + T columns) was 12.6 us a write
    at batch 64 on the H200 (20 a step), for ~6 MB."""
    dest.index_copy_(0, slots, final.to(dest.dtype).contiguous())

class DevicePools:
    def __init__(self, spec: ModelSpec, *, num_kv_blocks: int, block_size: int, max_seqs: int, scratch_slots: int,
                 dtype: torch.dtype, device: torch.device, verify_width: int = 1, ring_slots: int = 0,
                 inter: bool = True) -> None:
        """`inter`: allocate the row-by-row verify's copies (a wide verify needs none: it keeps its own tensors)."""
        if num_kv_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_kv_blocks and block_size must be positive, got {num_kv_blocks} and {block_size}")
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        self.scratch_block = num_kv_blocks  # the extra block
        self.max_seqs = max_seqs
        self.scratch_slots = tuple(range(max_seqs, max_seqs + scratch_slots))
        self.device = device
        slots = max_seqs + scratch_slots
        self.state_slots = slots
        kv_shape = (num_kv_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
        zeros = dict(dtype=dtype, device=device)
        self.keys = {layer: torch.zeros(kv_shape, **zeros) for layer in spec.attention_layers}
        self.values = {layer: torch.zeros(kv_shape, **zeros) for layer in spec.attention_layers}
        attn = spec.attention_layers
        # every paged position record in one tensor: [layer, block, offset] (kv layers, then QSA layers), so
        # reading every sequence's stamps is one gather
        qsa_layers = attn if spec.qsa is not None else ()
        self.paged_kinds = tuple(("kv", layer) for layer in attn) + tuple(("qsa", layer) for layer in qsa_layers)
        self.paged_pos = torch.full((len(self.paged_kinds), num_kv_blocks + 1, block_size), -1, dtype=torch.int32,
                                    device=device)
        self.kv_pos = {layer: self.paged_pos[i] for i, layer in enumerate(attn)}
        self.index_keys: dict[int, torch.Tensor] = {}
        self.index_pos: dict[int, torch.Tensor] = {}
        if spec.qsa is not None:
            self.index_keys = {layer: torch.zeros(num_kv_blocks + 1, block_size, spec.qsa.head_dim, **zeros)
                               for layer in attn}
            self.index_pos = {layer: self.paged_pos[len(attn) + i] for i, layer in enumerate(attn)}
        # the recurrent state is fp32 whatever the activations (bf16 state drifts over long decodes)
        state_dtype = torch.promote_types(dtype, torch.float32)
        # per-slot state by name; its stamp kind ("conv", "gdn", "ple_conv", "ple") and layer (-1: the context)
        self.state: dict[str, torch.Tensor] = {}
        self.kinds: dict[str, tuple[str, int]] = {}
        for layer in spec.gdn_layers:
            self._add(f"conv{layer}", ("conv", layer), torch.zeros(slots, spec.gdn_conv_dim, spec.gdn_conv_kernel,
                                                                   **zeros))
            self._add(f"gdn{layer}", ("gdn", layer), torch.zeros(slots, spec.gdn_v_heads, spec.gdn_k_dim,
                                                                 spec.gdn_v_dim, dtype=state_dtype, device=device))
        self.ple_context_len = 0
        self.ple_eos = 0
        if spec.ple is not None:
            for layer in spec.ple.layers:
                self._add(f"pconv{layer}", ("ple_conv", layer),
                          torch.zeros(slots, spec.hc_count * spec.hidden_size, spec.ple.conv_state_len, **zeros))
            self.ple_context_len, self.ple_eos = spec.ple.context_len, spec.ple.eos_token_id
            self._add("pctx", ("ple", -1), torch.full((slots, spec.ple.context_len), spec.ple.eos_token_id,
                                                      dtype=torch.int64, device=device))
        self.names = tuple(self.state)
        # stamps of every per-slot state in one tensor [state, slot] (the names' order): one gather reads them
        self.stamps = torch.zeros(len(self.names), slots, dtype=torch.int32, device=device)
        self.stamp = {name: self.stamps[i] for i, name in enumerate(self.names)}
        self.index = {name: i for i, name in enumerate(self.names)}
        # the GDN conv states' rows of `stamps`: stamp_states writes all of them at once (regions: one launch a step)
        self.conv_rows = torch.tensor([self.index[f"conv{layer}"] for layer in spec.gdn_layers], dtype=torch.long,
                                      device=device)
        # the same with the PLE layers' conv states (compiled regions write theirs in a region, stamped at the end)
        ple_layers = spec.ple.layers if spec.ple is not None else ()
        self.conv_rows_ple = torch.tensor([*(self.index[f"conv{layer}"] for layer in spec.gdn_layers),
                                           *(self.index[f"pconv{layer}"] for layer in ple_layers)],
                                          dtype=torch.long, device=device)
        self.gdn_conv = {layer: self.state[f"conv{layer}"] for layer in spec.gdn_layers}
        self.gdn_state = {layer: self.state[f"gdn{layer}"] for layer in spec.gdn_layers}
        self.ple_conv = {layer: self.state[f"pconv{layer}"] for layer in (spec.ple.layers if spec.ple else ())}
        # a verify's per-row state (index 0: before it), and the ring's boundary snapshots
        self.verify_width = verify_width
        self.inter: dict[str, torch.Tensor] = {}
        self.inter_stamps = torch.zeros(0, device=device)
        # a wide verify's per-token state: name -> (state after each row [T, B, ...], stamps [T, B], slots [B])
        self.kept: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # the positions tensor of the group whose kept stamps (its rows' positions + 1, [T, B] int32) put last built
        self._kept_at: torch.Tensor | None = None
        self._kept_stamps = torch.zeros(0, dtype=torch.int32, device=device)
        self._rows_cache: dict[tuple[int, ...], torch.Tensor] = {}
        if verify_width > 1 and inter:
            self.inter = {n: torch.zeros(verify_width + 1, *t.shape, dtype=t.dtype, device=device)
                          for n, t in self.state.items()}
            self.inter_stamps = torch.zeros(verify_width + 1, *self.stamps.shape, dtype=torch.int32, device=device)
        self.ring_slots = ring_slots
        self.ring: dict[str, torch.Tensor] = {}
        self.ring_stamps = torch.zeros(0, device=device)
        if ring_slots:
            self.ring = {n: torch.zeros(max_seqs, ring_slots, *t.shape[1:], dtype=t.dtype, device=device)
                         for n, t in self.state.items()}
            self.ring_stamps = torch.zeros(max_seqs, ring_slots, len(self.names), dtype=torch.int32, device=device)
        self._free = list(range(max_seqs - 1, -1, -1))  # pop() hands out the lowest slot first

    def _add(self, name: str, kind: tuple[str, int], t: torch.Tensor) -> None:
        self.state[name] = t
        self.kinds[name] = kind

    def allocate(self) -> int:
        if not self._free:
            raise SlotsExhausted(f"all {self.max_seqs} state slots are held (max_batch_size)")
        return self._free.pop()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def free(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)

    def clear(self, slot: int) -> None:
        """A slot's non-positional state back to a fresh sequence's (zeros, an all-EOS context), stamps 0."""
        # one multi-tensor launch per dtype instead of one per pool (~40 on the 2.7B config, before a fresh
        # sequence's prefill can start: on the H200 a replayed 2,048-token prefill's host part is ~1-2 ms)
        torch._foreach_zero_([pool[slot] for name, pool in self.state.items() if name != "pctx"]
                             + [self.stamps[:, slot]])
        if "pctx" in self.state:
            self.state["pctx"][slot].fill_(self.ple_eos)

    def slot_bytes(self) -> int:
        """What one ring or prefix snapshot holds (the quantity Capacities.ring_slot_bytes derives; the stamps
        travel with it but are bookkeeping, not state)."""
        return sum(p[0].numel() * p.element_size() for p in self.state.values())

    # -- moving one slot's state, with its stamps -----------------------------------------------------

    def _slot_views(self, slot: int) -> list[torch.Tensor]:
        """The slot's row of every state pool, in self.state's order, then its stamps (what moves with a slot)."""
        return [t[slot] for t in self.state.values()] + [self.stamps[:, slot]]

    def _ring_views(self, slot: int, ring_slot: int) -> list[torch.Tensor]:
        return [self.ring[n][slot, ring_slot] for n in self.state] + [self.ring_stamps[slot, ring_slot]]

    def copy_slot(self, slot: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Device copies of a slot's state and stamps (a prefix snapshot)."""
        return {n: t[slot].clone() for n, t in self.state.items()}, self.stamps[:, slot].clone()

    def load_slot(self, slot: int, state: dict[str, torch.Tensor], stamps: torch.Tensor) -> None:
        torch._foreach_copy_(self._slot_views(slot), [*(state[n] for n in self.state), stamps])

    def ring_store(self, slot: int, ring_slot: int) -> None:
        torch._foreach_copy_(self._ring_views(slot, ring_slot), self._slot_views(slot))

    def ring_load(self, slot: int, ring_slot: int) -> None:
        torch._foreach_copy_(self._slot_views(slot), self._ring_views(slot, ring_slot))

    def inter_save(self, slots: torch.Tensor, row: int) -> None:
        """inter[row][slots] = the slots' current state (row 0 before a verify; rows 1.. after each of its rows)."""
        for n, t in self.state.items():
            self.inter[n][row, slots] = t[slots]
        self.inter_stamps[row][:, slots] = self.stamps[:, slots]

    def inter_load(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """state[slots[b]] = the state after rows[b] rows of the slot's verify (row 0: before it), selected on the
        device: from a wide verify's kept tensors, else from the row-by-row copies."""
        if self.kept:  # rows >= 1 here: a commit keeps at least the verify's first row
            self._kept_load(slots, rows - 1)
            return
        for n, t in self.state.items():
            t[slots] = self.inter[n][rows, slots]
        self.stamps[:, slots] = self.inter_stamps[rows, :, slots].T

    def _kept_load(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """inter_load from a wide verify's kept tensors: state[slots[b]] = the state after row rows[b] (0: its first).
        A group's kept states share its slots and stamps tensors, so each slot's row in the group and the kept
        stamps are found once, and every state's stamp written in one launch: two launches a state (the gather and
        the write), where each state's own search and stamp were ~9 (~370 a verify of a 2.7B model, eager after
        its graph)."""
        at: dict[int, torch.Tensor] = {}  # id(a group's slots) -> each slot's row in that group
        # (id(kept stamps), id(slots)) -> (the stamps, each slot's row, the rows of `stamps` of the states they stamp)
        stamped: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
        for n, (per_token, stamps, kslots) in self.kept.items():
            b = at.get(id(kslots))
            if b is None:
                b = at[id(kslots)] = (kslots[None, :] == slots[:, None]).to(torch.int8).argmax(dim=1)
            self.state[n][slots] = per_token[rows, b].to(self.state[n].dtype)
            stamped.setdefault((id(stamps), id(kslots)), (stamps, b, []))[2].append(self.index[n])
        for stamps, b, names in stamped.values():
            which = self._state_rows(tuple(names))
            self.stamps[which[:, None], slots[None, :]] = stamps[rows, b][None, :].expand(len(names), -1)

    def _state_rows(self, names: tuple[int, ...]) -> torch.Tensor:
        """The rows of `stamps` `names` (indices) as a device tensor, built once a set (no host copy a commit)."""
        got = self._rows_cache.get(names)
        if got is None:
            got = self._rows_cache[names] = torch.tensor(names, dtype=torch.long, device=self.device)
        return got

    def put(self, name: str, slots: torch.Tensor, positions: torch.Tensor, final: torch.Tensor | None,
            per_token: torch.Tensor | None, keep: bool, ends: torch.Tensor) -> None:
        """A group's update of per-slot state `name` at `slots`, with its stamps: the state after the group's last
        token (`final` [B, ...], stamp `ends` [B] int32, the group's), or with `keep` (a wide verify) the state
        after each token (`per_token` [T, B, ...]) into inter[1..T], the live state untouched."""
        if keep:  # kept by reference until the commit reads it (a graph's static tensor lives until its next replay)
            if self._kept_at is not positions:  # the rows' stamps once a group, not two launches at each state's put
                self._kept_at, self._kept_stamps = positions, (positions + 1).T.to(torch.int32)
            self.kept[name] = (per_token, self._kept_stamps, slots)  # type: ignore[assignment]
        else:
            assert final is not None
            store_final(self.state[name], slots, final)
            self.stamp[name][slots] = ends

    def stamp_states(self, rows: torch.Tensor, slots: torch.Tensor, ends: torch.Tensor) -> None:
        """The stamps of several per-slot states (`rows` of `stamps`, e.g. conv_rows) at `slots` set to `ends` [B]
        int32: what put's stamp write does for each of them, in one launch (their data written before)."""
        self.stamps.index_put_((rows[:, None], slots[None, :]), ends[None, :].expand(rows.shape[0], -1))

    # -- paged stamps ---------------------------------------------------------------------------------

    def stamp_rows(self, flat_slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` [n] int32 into the paged position records at flat KV slots [n] (every kv/qsa layer)."""
        view = self.paged_pos.view(len(self.paged_kinds), -1)
        view.index_copy_(1, flat_slots, values[None].expand(view.shape[0], -1).contiguous())
