"""Sampling: the request's parameters (torch-free, `params`), the keyed sampler every backend runs (`keyed`),
and speculative decoding's verdicts on the same keyed draws (`verdicts`).

Only `params` is imported here, so the control plane (atlas.state) can import this package without torch.
"""

from atlas.sampling.params import DEFAULT_SEED, SamplingParams

__all__ = ["DEFAULT_SEED", "SamplingParams"]
