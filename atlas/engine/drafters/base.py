"""The engine-side drafter interface (n-gram, scripted; the MTP drafter runs inside the backend)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

from atlas.sampling.params import SamplingParams


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

