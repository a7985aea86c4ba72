"""Drafters: who proposes the tokens a verify checks.

- MTP: the model's MTP head, run by the backend inside its execute over its own pair-key rows (SeqWork.propose);
  the engine holds no drafter object for it (`make_drafter("mtp")` is None);
- `NgramDrafter`: prompt lookup, the tokens that followed the latest earlier occurrence of the context's tail;
- `ScriptedDrafter`: whatever a test says (arbitrary accept/reject patterns, full reject included).

A drafter only proposes: the target verifies every draft, so a wrong draft costs speed, never output.
"""

from atlas.engine.drafters.base import Drafter, DraftRequest
from atlas.engine.drafters.ngram import NgramDrafter, prompt_lookup
from atlas.engine.drafters.scripted import ScriptedDrafter


def make_drafter(kind: str) -> Drafter | None:
    """The engine-side drafter EngineConfig.drafter names; None for "mtp" (the backend drafts). "scripted" has
    no default script: a test passes its own."""
    if kind == "mtp":
        return None
    if kind == "ngram":
        return NgramDrafter()
    if kind == "scripted":
        raise ValueError("drafter 'scripted' needs a script: pass drafter=ScriptedDrafter(...) to the Engine")
    raise ValueError(f"unknown drafter {kind!r} (mtp, ngram, scripted)")


__all__ = ["DraftRequest", "Drafter", "NgramDrafter", "ScriptedDrafter", "make_drafter", "prompt_lookup"]
