"""Drafters: who proposes the tokens a verify checks. One interface, three kinds:

- `MtpDrafter`: the model's MTP head, run by the backend over its own pair-key rows (atlas-tiny has one);
- `NgramDrafter`: prompt lookup, the tokens that followed the latest earlier occurrence of the context's tail;
- `ScriptedDrafter`: whatever a test says (arbitrary accept/reject patterns, full reject included).

A drafter only proposes: the target verifies every draft, so a wrong draft costs speed, never output.
"""

from atlas.engine.drafters.base import Drafter, DraftRequest, make_drafter
from atlas.engine.drafters.mtp import MtpDrafter
from atlas.engine.drafters.ngram import NgramDrafter, prompt_lookup
from atlas.engine.drafters.scripted import ScriptedDrafter

__all__ = ["DraftRequest", "Drafter", "MtpDrafter", "NgramDrafter", "ScriptedDrafter", "make_drafter", "prompt_lookup"]
