"""The MTP drafter's per-sequence state on the CPU backend: its own KV rows, incrementally.

Conventions (the ones that are easy to get wrong):
- pair key k is (embed(t_{k+1}), hidden_k) at RoPE position k + 1, where hidden_k is the TARGET's final
  hidden state at position k;
- a sequence that has fed `computed` tokens holds exactly the keys 0 .. computed - 2 (rows == computed - 1):
  key computed - 1 would pair the target's last hidden with the sampled-but-unfed token, which is not
  committed yet;
- proposing builds transient rows: key computed - 1 from the target's hidden (draft 1), then keys from the
  drafter's own hidden (drafts 2..). Transient rows live in KV slots past `rows`, which are never read and
  are overwritten by the next append: a row built from a draft, or from a drafter hidden, is never kept.
  Committed rows are always rebuilt from the target's hidden of the verified token.
Slot i of the drafter's KV holds key i, so causal attention in slot space is causal over pair keys.

Every forward is one row-exact pass (atlas.backends.cpu.rows): each row's bits those of feeding the keys one at
a time, so the keys a verify's commit appends and the first draft's row after them (both from the target's
hidden) go through the drafter together (`append(..., then=token)`); `propose` takes that row from the cache
instead of computing it again. Logits are computed for the rows that draft, not for the keys appended.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from atlas.backends.cpu.attention import attention_forward
from atlas.backends.cpu.moe import dense_mlp, moe_block
from atlas.backends.cpu.rows import CHUNK, EXACT
from atlas.backends.cpu.state import KvPool
from atlas.backends.cpu.weights import PRE_FC_NORMS, joined
from atlas.backends.ops import rms_norm, rope_table
from atlas.model.spec import ModelSpec
from atlas.sampling.params import SamplingParams
from atlas.sampling.verdicts import draft_from

_BLOCK = 16


def mtp_layers(w: dict[str, torch.Tensor]) -> tuple[int, ...]:
    return tuple(sorted({int(k.split(".")[2]) for k in w if k.startswith("mtp.layers.")}))


@attrs.define
class Proposal:
    """The drafts last proposed for a sequence and, for sampled drafting, the drafter's q per draft."""

    position: int  # computed when proposed: the verify that uses it starts here
    drafts: tuple[int, ...]
    q: tuple[torch.Tensor | None, ...]


@attrs.define
class DrafterState:
    kv: KvPool
    rows: int = 0  # pair keys held: first_key .. first_key + rows - 1, key k in slot k - first_key
    # the target's final hidden at every fed position; rewinding keeps the exact hidden of the new end. After
    # a prefix hit the positions before the snapshot are None (only hidden_{position - 1} comes with it)
    target_hidden: list[torch.Tensor | None] = attrs.Factory(list)
    proposal: Proposal | None = None
    first_key: int = 0  # 0: the drafter saw the prompt; later when its context is off or after a prefix hit
    # the first draft's row, built by the append that preceded it: (key, token, drafter hidden [1, H])
    head: tuple[int, int, torch.Tensor] | None = None

    @property
    def last_key(self) -> int:
        return self.first_key + self.rows - 1

    @property
    def capacity(self) -> int:
        return self.kv.num_blocks * _BLOCK


class MtpDrafter:
    """Incremental MTP drafter over explicit per-sequence DrafterState (the stateless reference is
    atlas.backends.cpu.mtp.mtp_forward; tests check the two agree)."""

    def __init__(self, spec: ModelSpec, w: dict[str, torch.Tensor], dtype: torch.dtype, exact: bool) -> None:
        if "mtp.fc.weight" not in w:
            raise ValueError("this model has no MTP drafter weights (mtp.*); use drafter='ngram'")
        self.spec, self.w, self.dtype, self.exact = spec, w, dtype, exact
        self.layers = mtp_layers(w)

    def empty(self, first_key: int = 0) -> DrafterState:
        return DrafterState(kv=KvPool(self.spec, 1, _BLOCK, self.dtype, layers=self.layers), first_key=first_key)

    def _reserve(self, state: DrafterState, slots: int) -> None:
        if slots <= state.capacity:
            return
        blocks = max(-(-slots // _BLOCK), 2 * state.kv.num_blocks)
        grown = KvPool(self.spec, blocks, _BLOCK, self.dtype, layers=self.layers)
        old = state.kv.num_blocks
        for layer in self.layers:
            grown.keys[layer][:old] = state.kv.keys[layer]
            grown.values[layer][:old] = state.kv.values[layer]
        state.kv = grown

    def _forward(self, state: DrafterState, tokens: torch.Tensor, hidden: torch.Tensor, first_key: int,
                 wanted_from: int = 0) -> torch.Tensor:
        """Pair keys first_key.. (stored at slots from first_key - state.first_key: rows are compacted, RoPE
        stays in sequence space) in one pass: the drafter's hidden [n - wanted_from, H] of the rows from
        `wanted_from` on (its logits: `logits`). The rows before only build their keys: in the last layer they
        write K and V and stop (no query, output projection or MLP: nothing reads their hidden)."""
        spec, w, eps = self.spec, self.w, self.spec.rms_norm_eps
        rows = EXACT if self.exact else CHUNK
        n = tokens.shape[0]
        slot = first_key - state.first_key
        self._reserve(state, slot + n)
        # the embedding's and the hidden's norms as one grouped norm (bitwise the two)
        norms, _ = joined(w, "mtp.", PRE_FC_NORMS)
        both = torch.cat([w["embed_tokens.weight"][tokens], hidden], dim=-1)
        x = rows.mm(rms_norm(both, norms, eps, group=spec.hidden_size), w["mtp.fc.weight"])
        cos, sin = rope_table(torch.arange(first_key + 1, first_key + 1 + n), spec.rotary_dim, spec.rope_theta,
                              x.dtype)
        table = tuple(range(state.kv.num_blocks))
        for layer in self.layers:
            pre = f"mtp.layers.{layer}."
            h = rms_norm(x, w[pre + "input_layernorm.weight"], eps)
            skip = wanted_from if layer == self.layers[-1] else 0
            attn, _ = attention_forward(spec, w, pre + "self_attn.", layer, h, cos, sin, state.kv, table, slot,
                                        None, rows, attend_from=skip)
            x = x[skip:] + attn
            if not x.shape[0]:
                return x
            h = rms_norm(x, w[pre + "post_attention_layernorm.weight"], eps)
            x = x + (moe_block(spec.moe, w, pre + "mlp.", h, rows) if spec.moe is not None
                     else dense_mlp(w, pre + "mlp.", h, rows))
        return rms_norm(x, w["mtp.norm.weight"], eps)

    def logits(self, own: torch.Tensor) -> torch.Tensor:
        """The shared lm_head over drafter hidden rows [n, H]: [n, vocab] (row by row when exact, as the target's)."""
        head = self.w["lm_head.weight"]
        if self.exact:
            return torch.cat([row @ head.T for row in own.split(1)])
        return own @ head.T

    def append(self, state: DrafterState, start: int, tokens: Sequence[int], hidden: torch.Tensor,
               then: int | None = None) -> None:
        """The target fed `tokens` at [start, start + n) with final hiddens `hidden` [n, H]: add the pair keys
        this completes (key j - 1 for every fed position j >= 1), all from the target's hidden. `then`: the token
        sampled after them, whose first draft's row (key start + n - 1, transient) joins the same pass."""
        if start != len(state.target_hidden):
            raise ValueError(f"drafter holds hiddens for {len(state.target_hidden)} positions, fed at {start}")
        end = start + len(tokens)
        # position j completes key j - 1; keys below first_key are never built, held (carried) ones are skipped
        first = max(start, 1, state.last_key + 2 if state.rows else state.first_key + 1)
        if start > (state.last_key + 2 if state.rows else state.first_key + 1):
            raise ValueError(f"drafter keys end at {state.last_key} (first {state.first_key}): a feed at {start} "
                             "would leave a hole")
        state.proposal = state.head = None
        state.target_hidden.extend(hidden.unbind(0))
        if first >= end:
            return
        # the first draft's key end - 1 follows the keys appended: same pass, a transient row past `rows`
        built = [*tokens[first - start :], *(() if then is None else (then,))]
        pair_hidden = torch.stack(state.target_hidden[first - 1 : first - 1 + len(built)])  # type: ignore[arg-type]
        wanted = len(built) - (then is not None)  # only the first draft's row goes past its keys
        own = self._forward(state, torch.tensor(built, dtype=torch.long), pair_hidden, first - 1, wanted)
        state.rows = end - 1 - state.first_key
        if then is not None:
            state.head = (end - 1, then, own)

    def propose(self, state: DrafterState, next_token: int, k: int, params: SamplingParams) -> tuple[int, ...]:
        """Draft k tokens after `next_token` (sampled at position `computed`, not yet fed). Transient rows
        only: state.rows does not move."""
        computed = len(state.target_hidden)
        complete = state.last_key == computed - 2 if state.rows else state.first_key >= computed - 1
        if computed == 0 or not complete or state.target_hidden[-1] is None:
            raise ValueError(f"drafter keys {state.first_key}..{state.last_key} are not complete for {computed} "
                             "fed tokens")
        drafts: list[int] = []
        qs: list[torch.Tensor | None] = []
        token, hidden = next_token, state.target_hidden[-1][None]  # type: ignore[index]
        head, state.head = state.head, None
        for i in range(k):
            if i == 0 and head is not None and head[:2] == (computed - 1, token):
                hidden = head[2]  # built by the append before this proposal
            else:
                hidden = self._forward(state, torch.tensor([token]), hidden, computed - 1 + i)
            logits = self.logits(hidden)
            # the token this row drafts sits at position computed + 1 + i
            token, q = draft_from(logits[0], params, computed + 1 + i)
            drafts.append(token)
            qs.append(q)
        state.proposal = Proposal(computed, tuple(drafts), tuple(qs))
        return tuple(drafts)

    def rewind(self, state: DrafterState, position: int) -> None:
        """Back to `position` fed tokens: keys 0 .. position - 2 stay (they were built from verified
        tokens and the target's hiddens, which a rewind does not change)."""
        del state.target_hidden[position:]
        state.rows = max(0, min(state.last_key, position - 2) - state.first_key + 1)
        state.proposal = state.head = None

    def adopt(self, carried: DrafterState, last_key: int, position: int, hidden: torch.Tensor | None
              ) -> DrafterState:
        """A sequence resuming at `position` from a prefix snapshot keeps the carried keys up to `last_key`
        (rows past it are overwritten by its own appends, never read) and the snapshot's hidden_{position-1}."""
        state = DrafterState(kv=carried.kv, rows=max(0, last_key - carried.first_key + 1),
                             first_key=carried.first_key)
        state.target_hidden = [None] * (position - 1) + [hidden]
        return state

    def resumed(self, first_key: int, position: int, hidden: torch.Tensor | None) -> DrafterState:
        """A sequence resuming at `position` without a carry: no rows, keys from `first_key` on."""
        state = self.empty(first_key)
        state.target_hidden = [None] * (position - 1) + [hidden]
        return state
