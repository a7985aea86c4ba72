"""What the CUDA state store keeps on the host per sequence (`SeqState`) and per prefix snapshot (`PrefixEntry`)."""

from __future__ import annotations

import attrs
import torch


@attrs.define
class SeqState:
    slot: int
    position: int = 0  # tokens fed and committed: where the next chunk starts (the stamps are the measurement)
    ple_context: list[int] = attrs.field(factory=list)  # host mirror of the device's n-gram context
    table: tuple[int, ...] = ()  # the last block table it was fed through
    # the block table object whose first n entries the runner has checked (a decode step passes the same tuple
    # step after step: CudaBackend._check_chunk checks only what it has not)
    checked: tuple[tuple[int, ...], int] = ((), 0)
    ring: dict[int, tuple[int, list[int]]] = attrs.field(factory=dict)  # ring slot -> (position, context)
    pending: tuple[int, tuple[int, ...]] | None = None  # a verify awaiting its commit: (start, tokens)


@attrs.frozen
class PrefixEntry:
    position: int
    state: dict[str, torch.Tensor]
    stamps: torch.Tensor
    ple_context: list[int]
    tail: dict[str, torch.Tensor]  # the partial block's rows: k{layer}, v{layer}, i{layer} (QSA keys)
    last_hidden: torch.Tensor | None  # the target's final hidden at position - 1 (for the drafter)
