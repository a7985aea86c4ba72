"""A drafter that proposes whatever its script says: tests use it to force any accept/reject pattern."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from atlas.engine.drafters.base import DraftRequest


class ScriptedDrafter:
    name = "scripted"

    def __init__(self, script: Callable[[DraftRequest], Sequence[int]]) -> None:
        self.script = script
        self.requests: list[DraftRequest] = []  # every request seen, for tests to inspect

    def propose(self, request: DraftRequest) -> tuple[int, ...]:
        self.requests.append(request)
        return tuple(int(t) for t in self.script(request))[: request.k]
