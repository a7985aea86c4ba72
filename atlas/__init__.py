"""Atlas: an event-sourced, deterministic serving engine for hybrid language models."""

from atlas.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):  # lazy, so `import atlas` stays cheap for the CLI and the control plane
    if name == "LLM":
        from atlas.llm import LLM

        return LLM
    if name == "SamplingParams":
        from atlas.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
