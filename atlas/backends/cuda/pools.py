"""Device-resident data-plane state: paged KV and QSA index keys, slot-indexed GDN and PLE state.

Attention layers page their KV (and QSA raw index keys) through the block tables the engine hands out,
as the CPU backend does; everything a sequence carries that is not positional (GDN conv + recurrent
state, PLE short-conv state) lives in per-layer pools indexed by the sequence's state slot. One extra KV
block and `scratch_slots` extra state slots take the writes of a CUDA graph's padding rows.
"""

from __future__ import annotations

import torch

from atlas.errors import SlotsExhausted
from atlas.model.spec import ModelSpec


class DevicePools:
    def __init__(self, spec: ModelSpec, *, num_kv_blocks: int, block_size: int, max_seqs: int, scratch_slots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if num_kv_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_kv_blocks and block_size must be positive, got {num_kv_blocks} and {block_size}")
        self.num_kv_blocks, self.block_size = num_kv_blocks, block_size
        self.scratch_block = num_kv_blocks  # the extra block
        self.max_seqs = max_seqs
        self.scratch_slots = tuple(range(max_seqs, max_seqs + scratch_slots))
        slots = max_seqs + scratch_slots
        kv_shape = (num_kv_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
        zeros = dict(dtype=dtype, device=device)
        self.keys = {layer: torch.zeros(kv_shape, **zeros) for layer in spec.attention_layers}
        self.values = {layer: torch.zeros(kv_shape, **zeros) for layer in spec.attention_layers}
        self.index_keys: dict[int, torch.Tensor] = {}
        if spec.qsa is not None:
            self.index_keys = {layer: torch.zeros(num_kv_blocks + 1, block_size, spec.qsa.head_dim, **zeros)
                               for layer in spec.attention_layers}
        # the recurrent state is fp32 whatever the activations (bf16 state drifts over long decodes)
        state_dtype = torch.promote_types(dtype, torch.float32)
        self.gdn_conv = {layer: torch.zeros(slots, spec.gdn_conv_dim, spec.gdn_conv_kernel, **zeros)
                         for layer in spec.gdn_layers}
        self.gdn_state = {layer: torch.zeros(slots, spec.gdn_v_heads, spec.gdn_k_dim, spec.gdn_v_dim,
                                             dtype=state_dtype, device=device) for layer in spec.gdn_layers}
        self.ple_conv: dict[int, torch.Tensor] = {}
        if spec.ple is not None:
            self.ple_conv = {layer: torch.zeros(slots, spec.hc_count * spec.hidden_size, spec.ple.conv_state_len,
                                                **zeros) for layer in spec.ple.layers}
        self._free = list(range(max_seqs - 1, -1, -1))  # pop() hands out the lowest slot first

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
        """Zero a slot's non-positional state (a sequence starting afresh)."""
        for pool in (*self.gdn_conv.values(), *self.gdn_state.values(), *self.ple_conv.values()):
            pool[slot].zero_()

    def slot_bytes(self) -> int:
        return sum(p[0].numel() * p.element_size()
                   for p in (*self.gdn_conv.values(), *self.gdn_state.values(), *self.ple_conv.values()))
