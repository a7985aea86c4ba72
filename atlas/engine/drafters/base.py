"""The drafter interface and the factory that picks one from EngineConfig.drafter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from atlas.engine.sampling import SamplingParams


@attrs.frozen
class DraftRequest:
    """What a drafter may look at: the sequence's tokens (the last one is sampled, not yet fed), and how
    many drafts fit (`k` >= 1: the verify width, the request's budget and the step's token budget)."""

    seq_id: int
    request_id: str
    tokens: Sequence[int]
    prompt_len: int
    params: SamplingParams
    k: int

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class Drafter(Protocol):
    name: str

    def propose(self, request: DraftRequest) -> tuple[int, ...]:
        """Up to request.k draft tokens for the positions after request.tokens (fewer, or none, is fine)."""
        ...


def make_drafter(kind: str, backend: Any) -> Drafter:
    """The drafter EngineConfig.drafter names. "scripted" has no default script: a test passes its own."""
    from atlas.engine.drafters.mtp import MtpDrafter
    from atlas.engine.drafters.ngram import NgramDrafter

    if kind == "mtp":
        return MtpDrafter(backend)
    if kind == "ngram":
        return NgramDrafter()
    if kind == "scripted":
        raise ValueError("drafter 'scripted' needs a script: pass drafter=ScriptedDrafter(...) to the Engine")
    raise ValueError(f"unknown drafter {kind!r} (mtp, ngram, scripted)")
