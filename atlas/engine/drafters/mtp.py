"""The MTP drafter: the backend runs the model's MTP head over its own pair-key rows (see
atlas.backends.cpu.drafter for the conventions); this side only asks."""

from __future__ import annotations

from typing import Any

from atlas.engine.drafters.base import DraftRequest


class MtpDrafter:
    name = "mtp"

    def __init__(self, backend: Any) -> None:
        if not callable(getattr(backend, "propose_drafts", None)) or getattr(backend, "drafter", None) is None:
            raise ValueError(f"backend {getattr(backend, 'name', '?')!r} runs no MTP drafter "
                             "(build it with mtp_drafter=True, or use drafter='ngram')")
        self.backend = backend

    def propose(self, request: DraftRequest) -> tuple[int, ...]:
        return self.backend.propose_drafts(request.seq_id, request.tokens[-1], request.k, request.params)
