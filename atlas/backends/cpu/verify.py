"""The K-wide verify and its exact partial-accept commit, on the CPU reference backend.

A verify feeds [last token, d1 .. d_{K-1}] as one pass through the stack (`forward_rows`): the products
batched, each row's bits those of a decode of that row (atlas.backends.cpu.rows), and it keeps the sequence's
state after every row: the per-position intermediates the pass computes anyway (GDN conv + recurrent state, PLE
context + short-conv state; KV rows and QSA raw keys are positional, so a row's are a slice). Nothing is
committed by the verify itself. The commit of the accepted prefix installs the intermediate after row
`rows - 1` (chosen by index, never recomputed), which is bitwise the state of a sequence that decoded those
rows one at a time.

QSA selection is applied per row (each query over its own visible prefix), so a verify that crosses the inert
bound is exact here: the CPU backend reports `verify_crosses_qsa_bound = True`.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from atlas.backends.cpu.decoder import forward_rows
from atlas.backends.cpu.state import KvPool, SequenceState
from atlas.errors import VerifyRefused
from atlas.model.spec import ModelSpec


@attrs.frozen
class PendingVerify:
    """A verify that ran and awaits the engine's commit. `states[i]` is the state after row i."""

    start: int
    tokens: tuple[int, ...]
    states: tuple[SequenceState, ...]
    hidden: torch.Tensor  # [K, H], the target's final hidden per row (the drafter pairs them on commit)
    then: int | None = None  # the token sampled after the kept rows, when the drafter proposes after it


def run_verify(
    spec: ModelSpec,
    w: dict[str, torch.Tensor],
    kv: KvPool,
    state: SequenceState,
    tokens: Sequence[int],
    start: int,
    block_table: tuple[int, ...],
) -> PendingVerify:
    """Feed the K verify rows at [start, start + K) in one pass; `state` itself is left untouched."""
    hidden, states = forward_rows(spec, w, kv, state, torch.tensor(list(tokens), dtype=torch.long), start,
                                  block_table)
    return PendingVerify(start, tuple(tokens), states, hidden)


def check_commit(spec: ModelSpec, current: SequenceState, pending: PendingVerify, rows: int, depth: int) -> None:
    """Pre-validate a commit of `rows` verify rows against every layer before anything is touched."""
    k = len(pending.tokens)
    if not 1 <= rows <= k:
        raise VerifyRefused(f"commit of {rows} rows of a verify of width {k}: at least the first position and at "
                            f"most K are committed")
    if rows > min(len(pending.states), depth):
        raise VerifyRefused(f"commit of {rows} rows needs {rows} per-token intermediates; the pool holds "
                            f"{min(len(pending.states), depth)} (verify_width {depth}). No state was changed")
    if current.kv_tokens != pending.start:
        raise VerifyRefused(f"the sequence moved to {current.kv_tokens} since its verify at {pending.start}")
    target = pending.states[rows - 1]
    end = pending.start + rows
    if (target.kv_tokens, target.ssm_position, target.ple_position) != (end, end, end):
        raise VerifyRefused(f"intermediate {rows - 1} is at positions {target.kv_tokens}/{target.ssm_position}/"
                            f"{target.ple_position}, expected {end}")
    for layer in spec.gdn_layers:
        if layer not in target.gdn_conv or layer not in target.gdn_recurrent:
            raise VerifyRefused(f"GDN layer {layer} has no intermediate for row {rows - 1}")
    for layer, keys in target.qsa_keys.items():
        if keys.shape[0] != end:
            raise VerifyRefused(f"QSA layer {layer} holds {keys.shape[0]} keys for row {rows - 1}, expected {end}")
    if spec.ple is not None and (target.ple_context is None or set(target.ple_conv) != set(spec.ple.layers)):
        raise VerifyRefused(f"PLE state incomplete for row {rows - 1}")
