"""The fused keyed-sampling kernel against the torch reference (atlas.sampling.keyed.keyed_argmax_torch): the
same token on every row (greedy, temperature, min_p, top_k/top_p thresholds, banned tokens, greedy ties across
blocks), for any split of the vocabulary and any float width of the logits. Interpreted without a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from atlas_kernels.keyed_sample import keyed_argmax

from atlas.sampling.keyed import (
    DRAFT_SALT,
    SAMPLE_SALT,
    keyed_argmax_torch,
    row_temperature,
    rows_of,
    sample,
    threshold,
)
from atlas.sampling.params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PARAMS = [
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(),
    SamplingParams(temperature=1.2, top_p=0.9, seed=2),
    SamplingParams(temperature=0.5, min_p=0.1, seed=-3),
    SamplingParams(temperature=1.0, top_k=7, seed=2**70),
    SamplingParams(temperature=2.0, seed=5),
    SamplingParams(temperature=0.3, top_p=0.5, top_k=40, min_p=0.01, seed=6),
]


def fused(key: torch.Tensor, rows, salt: int, splits: int | None = None) -> torch.Tensor:
    last = threshold(key, rows) if rows.filtered else torch.full((key.shape[0],), float("-inf"), dtype=torch.float64)
    zmax = key.max(dim=-1).values.to(torch.float64) / row_temperature(rows)
    return keyed_argmax(key, rows.temperature, rows.log_min_p, last.to(key.device), zmax, rows.seed,
                        rows.position, salt, splits=splits)


def batch(n: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    key = (torch.randn(n, vocab, generator=g) * 2).to(torch.bfloat16).float()
    key[3, [10, 200, 1500]] = float("-inf")  # banned tokens
    key[1, 5] = key[1, 2000] = key[1].max() + 1.0  # a greedy tie across blocks: index 5 wins
    params = [PARAMS[i % len(PARAMS)] for i in range(n)]
    positions = torch.randint(0, 2**34, (n,), generator=g).tolist()
    return key, params, positions


@pytest.mark.parametrize("splits", [1, 2, None])
def test_the_kernel_draws_the_references_tokens(splits: int | None) -> None:
    key, params, positions = batch(14, 2500, 0)  # three blocks of 1024, the last one partial
    rows = rows_of(params, positions)
    last = threshold(key, rows)
    for salt in (SAMPLE_SALT, DRAFT_SALT):
        want = keyed_argmax_torch(key, rows, last, salt)
        got = fused(key.to(DEVICE), rows_of(params, positions, DEVICE), salt, splits).cpu()
        assert got.tolist() == want.tolist()
    assert want[1] == 5  # the tie went to the lowest index
    assert int(want[3]) not in (10, 200, 1500)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_kernel_reads_any_float_width(dtype: torch.dtype) -> None:
    key, params, positions = batch(7, 2100, 1)
    rows = rows_of(params, positions)
    want = sample(key, rows)  # the torch path (CPU tensors never take the kernel)
    got = fused(key.to(DEVICE, dtype), rows_of(params, positions, DEVICE), SAMPLE_SALT).cpu()
    assert got.tolist() == want.tolist()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_the_gpu_sample_takes_the_kernel_and_matches_the_cpu() -> None:
    from atlas.sampling import keyed

    assert keyed._fused() is keyed_argmax  # the dispatch a CUDA tensor takes
    key, params, positions = batch(64, 65536, 2)
    want = sample(key, rows_of(params, positions)).tolist()
    assert sample(key.cuda(), rows_of(params, positions, "cuda")).tolist() == want
