"""Re-exports of atlas.sampling, where sampling lives now (kept so existing imports keep working).

Randomness is keyed by (request seed, position, token) so a request's tokens never depend on what else is in
the batch, on chunking, or on the order of requests, and a replay reproduces them exactly.
"""

from atlas.sampling.keyed import filtered_probs, logprobs_of, sample_token
from atlas.sampling.params import DEFAULT_SEED, SamplingParams

__all__ = ["DEFAULT_SEED", "SamplingParams", "filtered_probs", "logprobs_of", "sample_token"]
