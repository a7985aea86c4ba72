"""The MTP drafter on the device, batched over sequences (the CPU reference is atlas.backends.cpu.drafter).

Conventions, as the reference's:
- pair key k is (embed(t_{k+1}), hidden_k) at RoPE position k + 1, hidden_k the TARGET's final hidden at k;
- a sequence that fed `fed` tokens holds keys first_key .. fed - 2 (built from verified tokens and the target's
  hidden only); the whole prompt is drafter-prefilled (every prompt position completes a key);
- proposing builds transient rows from the drafter's own hidden (drafts 2..), written pending (stamp negative,
  never counted) past the held rows, overwritten by the next append.
Rows live per state slot in a dense pool [slots, capacity, kv_heads, head_dim] per MTP layer, key k at row
k - first_key, with an int32 position record per row (its row index, -1 when it holds nothing counted) written by
the same index_copy: the "drafter" stamp is the leading run of rows that carry their own index.
`exact` (the fp32 parity mode) builds one key per sequence at a time, as a decode does, so a commit's rows are
bitwise the rows single decodes build.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from atlas.backends.cuda.batch import to_device
from atlas.backends.cuda.moe import moe_layer
from atlas.backends.cuda.pools import DevicePools
from atlas.backends.ops import acc_dtype, apply_rope, dense_mlp, rms_norm, rope_table
from atlas.model.spec import ModelSpec
from atlas.plan import PrefixRestore, SeqWork
from atlas.sampling.keyed import rows_of
from atlas.sampling.verdicts import draft


@attrs.define
class _Proposal:
    position: int  # fed tokens when proposed: the verify that uses it starts here
    drafts: tuple[int, ...]
    q: torch.Tensor | None  # [k, vocab] float64, None for greedy drafting (point masses)


@attrs.define
class _DraftSeq:
    slot: int
    first_key: int = 0
    rows: int = 0  # keys held: first_key .. first_key + rows - 1
    fed: int = 0  # target positions fed
    last_hidden: torch.Tensor | None = None  # the target's final hidden at fed - 1
    ring: dict[int, tuple[int, torch.Tensor | None]] = attrs.field(factory=dict)  # ring slot -> (fed, hidden)
    proposal: _Proposal | None = None

    @property
    def last_key(self) -> int:
        return self.first_key + self.rows - 1


@attrs.frozen
class _Carry:
    first_key: int
    rows: int
    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]


class CudaMtpDrafter:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], pools: DevicePools, *,
                 shared: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, capacity: int,
                 exact: bool) -> None:
        if "mtp.fc.weight" not in weights:
            raise ValueError("this model has no MTP drafter weights (mtp.*); use drafter='ngram'")
        self.spec, self.dtype, self.device, self.exact = spec, dtype, device, exact
        self.w = {k: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                  for k, t in weights.items() if k.startswith("mtp.")}
        self.embed, self.head = shared["embed_tokens.weight"], shared["lm_head.weight"]
        self.layers = tuple(sorted({int(k.split(".")[2]) for k in self.w if k.startswith("mtp.layers.")}))
        for layer in self.layers:  # moe_layer's fused input projection (as prepare_weights builds the target's)
            m = f"mtp.layers.{layer}.mlp."
            if spec.moe is not None and m + "gate.weight" in self.w:
                self.w[m + "fused_in.weight"] = torch.cat([
                    self.w[m + "gate.weight"], self.w[m + "shared_expert.gate_proj.weight"],
                    self.w[m + "shared_expert.up_proj.weight"], self.w[m + "shared_expert_gate.weight"]]).contiguous()
        slots = pools.state_slots
        self.capacity = capacity
        shape = (slots, capacity, spec.num_kv_heads, spec.head_dim)
        self.k = {layer: torch.zeros(shape, dtype=dtype, device=device) for layer in self.layers}
        self.v = {layer: torch.zeros(shape, dtype=dtype, device=device) for layer in self.layers}
        self.pos = torch.full((slots, capacity), -1, dtype=torch.int32, device=device)
        self.seqs: dict[int, _DraftSeq] = {}
        self.carried: _Carry | None = None

    # -- lifecycle ------------------------------------------------------------------------------------

    def reset(self, seq_id: int, slot: int, first_key: int = 0) -> None:
        self.seqs[seq_id] = _DraftSeq(slot=slot, first_key=first_key)
        self.pos[slot, 0] = -1  # an earlier owner's rows stop counting

    def release(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def stamps(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """[S] int32 on the device: per sequence, the leading run of rows whose record is their own index."""
        slots = torch.tensor([self.seqs[s].slot if s in self.seqs else -1 for s in seq_ids], device=self.device)
        rec = self.pos[slots.clamp(min=0)]
        want = torch.arange(self.capacity, device=self.device, dtype=torch.int32)
        match = (rec == want) & (slots >= 0)[:, None]
        match = torch.cat([match, torch.zeros_like(match[:, :1])], dim=1)
        return (~match).to(torch.int8).argmax(dim=1).to(torch.int32)

    def digest(self, h: Any, seq_id: int) -> None:
        d = self.seqs.get(seq_id)
        if d is None:
            return
        h.update(f"d{d.first_key}:{d.rows}".encode())
        for layer in self.layers:
            for name, pool in (("dk", self.k), ("dv", self.v)):
                t = pool[layer][d.slot, : d.rows].contiguous().cpu()
                h.update(f"{name}{layer}{tuple(t.shape)}".encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")

    # -- the ring, prefix snapshots and the carry -----------------------------------------------------

    def snapshot(self, seq_id: int, ring_slot: int, position: int) -> None:
        d = self.seqs[seq_id]
        d.ring[ring_slot] = (position, None if d.last_hidden is None else d.last_hidden.clone())

    def rewind(self, seq_id: int, position: int, ring_slot: int) -> None:
        """Back to `position` fed tokens: keys 0 .. position - 2 stay (verified tokens, the target's hidden)."""
        d = self.seqs.get(seq_id)
        if d is None:
            return
        held = d.ring.get(ring_slot)
        d.last_hidden = held[1] if held is not None and held[0] == position else None
        d.ring = {s: v for s, v in d.ring.items() if v[0] <= position}
        d.fed = position
        d.rows = max(0, min(d.last_key, position - 2) - d.first_key + 1)
        d.proposal = None
        if d.rows < self.capacity:
            self.pos[d.slot, d.rows] = -1

    def last_hidden(self, seq_id: int) -> torch.Tensor | None:
        d = self.seqs.get(seq_id)
        return None if d is None or d.last_hidden is None else d.last_hidden.clone()

    def has_carry(self) -> bool:
        return self.carried is not None

    def drop_carry(self) -> None:
        self.carried = None

    def store_carry(self, seq_id: int) -> None:
        d = self.seqs.get(seq_id)
        if d is None:
            self.carried = None
            return
        self.carried = _Carry(d.first_key, d.rows, {layer: self.k[layer][d.slot, : d.rows].clone() for layer in self.layers},
                              {layer: self.v[layer][d.slot, : d.rows].clone() for layer in self.layers})

    def resume(self, seq_id: int, slot: int, order: PrefixRestore, hidden: torch.Tensor | None) -> None:
        """A sequence starting at order.position from a prefix snapshot: the carried keys up to
        order.drafter_last_key when `adopt`, else none from order.drafter_first_key on."""
        if order.adopt:
            carry = self.carried
            assert carry is not None  # the store refused an adoption without one
            rows = min(carry.rows, max(0, order.drafter_last_key - carry.first_key + 1))
            d = _DraftSeq(slot=slot, first_key=carry.first_key, rows=rows)
            for layer in self.layers:
                self.k[layer][slot, :rows] = carry.k[layer][:rows]
                self.v[layer][slot, :rows] = carry.v[layer][:rows]
            self.pos[slot, :rows] = torch.arange(rows, dtype=torch.int32, device=self.device)
            self.carried = None
        else:
            d = _DraftSeq(slot=slot, first_key=order.drafter_first_key)
        if d.rows < self.capacity:
            self.pos[slot, d.rows] = -1
        d.fed, d.last_hidden = order.position, hidden
        self.seqs[seq_id] = d

    # -- building keys --------------------------------------------------------------------------------

    def feed(self, fed: Sequence[tuple[int, int, tuple[int, ...], int]], hidden: dict[int, torch.Tensor]) -> None:
        """The target fed (seq_id, start, tokens, drafter_first_key) with final hiddens `hidden[seq_id]` [n, H]:
        add the pair keys this completes (key j - 1 for every fed position j >= 1), batched over sequences."""
        jobs = []
        for seq_id, start, tokens, first_key in fed:
            d = self.seqs.get(seq_id)
            if d is None:
                continue
            if start == 0:
                d.first_key, d.rows, d.fed, d.last_hidden, d.ring = first_key, 0, 0, None, {}
            if start != d.fed:
                raise ValueError(f"drafter holds hiddens for {d.fed} positions, fed at {start}")
            end = start + len(tokens)
            nxt = d.last_key + 2 if d.rows else d.first_key + 1
            if start > nxt:
                raise ValueError(f"drafter keys end at {d.last_key} (first {d.first_key}): a feed at {start} "
                                 "would leave a hole")
            first = max(start, 1, nxt)
            h = hidden[seq_id].reshape(len(tokens), -1)
            d.proposal = None
            if first < end:
                before = h[first - 1 - start :] if first - 1 >= start else torch.cat([d.last_hidden[None], h])  # type: ignore[index]
                pair_hidden = before[: end - first]
                jobs.append((d, first - 1, list(tokens[first - start :]), pair_hidden))
            d.fed, d.last_hidden = end, h[-1].clone()  # (a graph's static output is overwritten next step)
        if jobs:
            self._build(jobs)

    def _build(self, jobs: list[tuple[_DraftSeq, int, list[int], torch.Tensor]]) -> None:
        """Write keys key0.. of each job, committed (rows move): one key per sequence at a time when exact."""
        if self.exact or len({len(j[2]) for j in jobs}) > 1:
            for t in range(max(len(j[2]) for j in jobs)):
                part = [(d, key + t, toks[t : t + 1], hid[t : t + 1]) for d, key, toks, hid in jobs if t < len(toks)]
                self._build_same(part)
        else:
            self._build_same(jobs)

    def _build_same(self, jobs: list[tuple[_DraftSeq, int, list[int], torch.Tensor]]) -> None:
        tokens = to_device([j[2] for j in jobs], self.device)
        hidden = torch.stack([j[3] for j in jobs])
        self._forward([j[0].slot for j in jobs], [j[1] - j[0].first_key for j in jobs], [j[1] for j in jobs],
                      tokens, hidden, pending=False)
        for d, key, toks, _ in jobs:
            d.rows = key + len(toks) - d.first_key

    def _forward(self, slots: list[int], rows: list[int], keys: list[int], tokens: torch.Tensor, hidden: torch.Tensor,
                 *, pending: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Pair keys keys[b].. (T per sequence) stored at rows rows[b].. of each slot: (logits [B, T, V], the
        drafter's hidden [B, T, H]). Rows are stamped with their index (negative while `pending`)."""
        spec, w, eps, dev = self.spec, self.w, self.spec.rms_norm_eps, self.device
        b, t = tokens.shape
        nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        if max(rows) + t > self.capacity:
            raise ValueError(f"drafter rows up to {max(rows) + t} exceed its capacity {self.capacity}")
        # (queued copies: a drafting step's host values never wait for the device; to_device)
        row = to_device(rows, dev)[:, None] + torch.arange(t, device=dev)  # [B, T]
        key = to_device(keys, dev)[:, None] + torch.arange(t, device=dev)
        slot = to_device(slots, dev)
        flat = (slot[:, None] * self.capacity + row).reshape(-1)
        emb = rms_norm(self.embed[tokens], w["mtp.pre_fc_norm_embedding.weight"], eps)
        x = torch.cat([emb, rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1) @ w["mtp.fc.weight"].T
        cos, sin = rope_table((key + 1).reshape(-1), spec.rotary_dim, spec.rope_theta, x.dtype)
        length = max(rows) + t
        stamp = (-(row + 2) if pending else row).to(torch.int32).reshape(-1)
        self.pos.view(-1).index_copy_(0, flat, stamp)
        # the row past the new keys stops any stale chain (indices on the host: no mask, no sync)
        past = [s * self.capacity + r + t for s, r in zip(slots, rows, strict=True) if r + t < self.capacity]
        if not pending and past:
            self.pos.view(-1)[to_device(past, dev)] = -1
        mask = torch.arange(length, device=dev)[None, None, :] <= row[..., None]  # [B, T, L]
        for layer in self.layers:
            pre = f"mtp.layers.{layer}."
            h = rms_norm(x, w[pre + "input_layernorm.weight"], eps).reshape(b * t, -1)
            a = pre + "self_attn."
            q, gate = (h @ w[a + "q_proj.weight"].T).view(b * t, nh, 2 * hd).chunk(2, dim=-1)
            q = rms_norm(q, w[a + "q_norm.weight"], eps)
            k = rms_norm((h @ w[a + "k_proj.weight"].T).view(b * t, nkv, hd), w[a + "k_norm.weight"], eps)
            v = (h @ w[a + "v_proj.weight"].T).view(b * t, nkv, hd)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.k[layer].view(-1, nkv, hd).index_copy_(0, flat, k)
            self.v[layer].view(-1, nkv, hd).index_copy_(0, flat, v)
            keys_, values = self.k[layer][slot, :length], self.v[layer][slot, :length]  # [B, L, nkv, hd]
            group = nh // nkv
            keys_ = keys_.repeat_interleave(group, dim=2)
            values = values.repeat_interleave(group, dim=2)
            scores = torch.einsum("bqhd,bkhd->bhqk", q.view(b, t, nh, hd), keys_) * hd**-0.5
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
            probs = torch.softmax(scores.to(acc_dtype(x.dtype)), dim=-1).to(x.dtype)
            out = torch.einsum("bhqk,bkhd->bqhd", probs, values).reshape(b * t, nh * hd)
            out = out * torch.sigmoid(gate.reshape(b * t, nh * hd))
            x = x + (out @ w[a + "o_proj.weight"].T).view(b, t, -1)
            h = rms_norm(x, w[pre + "post_attention_layernorm.weight"], eps).reshape(b * t, -1)
            if spec.moe is not None and pre + "mlp.fused_in.weight" in w:
                x = x + moe_layer(spec.moe, w, pre + "mlp.", h, eager=False).view(b, t, -1)
            else:
                x = x + dense_mlp(w, pre + "mlp.", h).view(b, t, -1)
        out_h = rms_norm(x, w["mtp.norm.weight"], eps)
        return out_h @ self.head.T, out_h

    # -- proposing ------------------------------------------------------------------------------------

    def propose(self, asks: Sequence[tuple[SeqWork, int]]) -> dict[int, tuple[int, ...]]:
        """Draft w.propose tokens after each sampled `token` (at position fed, not yet fed), batched: transient
        rows only, the drafts' tokens in one device->host copy; each proposal's q kept for the verify."""
        live = [(w, tok, self.seqs[w.seq_id]) for w, tok in asks if w.seq_id in self.seqs]
        for w, _, d in live:
            complete = d.last_key == d.fed - 2 if d.rows else d.first_key >= d.fed - 1
            if d.fed == 0 or not complete or d.last_hidden is None:
                raise ValueError(f"sequence {w.seq_id}: drafter keys {d.first_key}..{d.last_key} are not complete "
                                 f"for {d.fed} fed tokens")
        if not live:
            return {}
        k = max(w.propose for w, _, _ in live)
        tokens = to_device([[tok] for _, tok, _ in live], self.device)
        hidden = torch.stack([d.last_hidden for _, _, d in live])[:, None]  # type: ignore[misc]
        params = [w.sampling for w, _, _ in live]
        drafted, qs = [], []
        for i in range(k):
            keys = [d.fed - 1 + i for _, _, d in live]
            logits, hidden = self._forward([d.slot for _, _, d in live], [key - d.first_key for key, (_, _, d) in
                                                                           zip(keys, live, strict=True)],
                                           keys, tokens, hidden, pending=True)
            # the token this row drafts sits at position fed + 1 + i
            picked, q = draft(logits[:, 0], rows_of(params, [d.fed + 1 + i for _, _, d in live], self.device))
            drafted.append(picked)
            qs.append(q)
            tokens = picked[:, None]
        host = torch.stack(drafted, dim=1).tolist()  # the one copy of every sequence's drafts
        q_all = torch.stack(qs, dim=1)  # [B, k, V]
        out: dict[int, tuple[int, ...]] = {}
        for b, (w, _, d) in enumerate(live):
            drafts = tuple(int(t) for t in host[b][: w.propose])
            d.proposal = _Proposal(d.fed, drafts, None if w.sampling.greedy else q_all[b, : w.propose])
            out[w.seq_id] = drafts
        return out

    def proposals(self, members: Sequence[SeqWork], width: int, vocab: int
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The drafter's q for each verify's drafts it proposed (rejection sampling keeps p exact); None when
        every draft is a point mass (greedy drafting, or drafts from elsewhere)."""
        found: list[torch.Tensor | None] = []
        for w in members:
            d = self.seqs.get(w.seq_id)
            p = None if d is None else d.proposal
            ok = p is not None and p.q is not None and p.position == w.start and p.drafts[: len(w.drafts)] == w.drafts
            found.append(p.q[: len(w.drafts)] if ok else None)  # type: ignore[union-attr]
        if all(q is None for q in found):
            return None, None
        q = torch.zeros(len(members), width, vocab, dtype=torch.float64, device=self.device)
        has_q = torch.zeros(len(members), width, dtype=torch.bool, device=self.device)
        for b, qb in enumerate(found):
            if qb is not None:
                q[b, : qb.shape[0]], has_q[b, : qb.shape[0]] = qb, True
        return q, has_q

