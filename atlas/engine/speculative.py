"""Re-exports of speculative decoding's decisions, which live in atlas.sampling now: the verdicts on the keyed
draws (atlas.sampling.verdicts) and the torch-free bookkeeping (atlas.sampling.acceptance)."""

from atlas.sampling.acceptance import (
    AcceptanceStats,
    RowVerdict,
    VerifyRefused,
    accepted_prefix,
    chain_length,
    verdict_bits,
)
from atlas.sampling.keyed import filtered_probs, logprobs_of, sample_token
from atlas.sampling.params import SamplingParams
from atlas.sampling.verdicts import draft_from, row_verdict, verify_rows

__all__ = ["AcceptanceStats", "RowVerdict", "SamplingParams", "VerifyRefused", "accepted_prefix", "chain_length",
           "draft_from", "filtered_probs", "logprobs_of", "row_verdict", "sample_token", "verdict_bits",
           "verify_rows"]
