"""The sort-free threshold for 16-bit logits (atlas_kernels.keyed_threshold) against the sorting reference
(atlas.sampling.keyed.threshold_sorted): the same `last` on every row, for top_p, top_k, min_p and their mixes,
banned (-inf) tokens, ties across the k-th value, -0.0 beside +0.0, greedy rows, bf16 and fp16. Interpreted
without a GPU (one call: the interpreter takes ~1 s a row), compiled at the benchmark's vocabulary on one."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from atlas_kernels.keyed_threshold import bin_values, keyed_threshold

from atlas.sampling.keyed import row_temperature, rows_of, sample, threshold, threshold_sorted
from atlas.sampling.params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PARAMS = [
    SamplingParams(temperature=0.8, top_p=0.95, seed=1),
    SamplingParams(temperature=1.0, top_k=7, seed=2),
    SamplingParams(temperature=0.5, min_p=0.1, top_p=0.5, seed=3),
    SamplingParams(temperature=0.3, top_p=0.5, top_k=40, min_p=0.01, seed=4),
    SamplingParams(),  # greedy in a filtered batch: its threshold is computed (T = 1) and never used
    SamplingParams(temperature=2.0, top_p=0.99, seed=5),
    SamplingParams(temperature=1.0, top_k=1, seed=6),
    SamplingParams(temperature=0.7, top_p=0.2, seed=7),
]


def damaged(n: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    key = (torch.randn(n, vocab, generator=g) * 2).to(dtype)
    key[2 % n, : vocab // 50] = float("-inf")  # banned tokens
    key[3 % n, 7], key[3 % n, 8] = -0.0, 0.0  # equal values, different bit patterns
    key[1 % n, :20] = key[1 % n].max()  # a tie of 20 at the top: top_k 7 keeps all of them
    key[6 % n, 100:103] = key[6 % n].max()  # top_k 1 with a three-way tie at the maximum
    return key


def ours(key: torch.Tensor, rows) -> torch.Tensor:
    zmax = key.max(dim=-1).values.to(torch.float64) / row_temperature(rows)
    # interpreted, a larger scan step: 8 steps a row instead of 64 (the same code; the GPU runs the default)
    return keyed_threshold(key, rows.temperature, rows.log_min_p, rows.top_k, rows.top_p, zmax,
                           **({"scan_block": 8192} if DEVICE == "cpu" else {}))


def test_the_bins_are_the_values_in_descending_order() -> None:
    values = bin_values(torch.bfloat16, torch.device("cpu"))
    finite = values[~values.isnan()]
    assert finite[0] == float("inf") and finite[-1] == float("-inf")
    assert bool((finite[:-1] >= finite[1:]).all())
    assert int((finite == 0).sum()) == 2  # +0.0 and -0.0: the kernel puts every zero in the first


@pytest.mark.parametrize("dtype", [torch.bfloat16] if DEVICE == "cpu" else [torch.bfloat16, torch.float16])
def test_the_threshold_equals_the_sorting_reference(dtype: torch.dtype) -> None:
    key = damaged(len(PARAMS), 3000 if DEVICE == "cpu" else 65536, dtype, 0).to(DEVICE)
    rows = rows_of(PARAMS, list(range(len(PARAMS))), device=DEVICE)
    got, want = ours(key, rows), threshold_sorted(key, rows)
    assert torch.equal(got, want), (got, want)
    if DEVICE == "cuda":  # the dispatch takes the kernel there, and the sampler draws with it
        assert torch.equal(threshold(key, rows), want)


@pytest.mark.skipif(DEVICE == "cpu", reason="many rows at the benchmark's vocabulary: compiled kernels only")
def test_many_random_rows_on_the_gpu_agree_and_draw_the_same_tokens() -> None:
    g = torch.Generator().manual_seed(1)
    params = [SamplingParams(temperature=float(t), top_p=float(p), top_k=int(k), min_p=float(m), seed=i)
              for i, (t, p, k, m) in enumerate(zip(torch.rand(256, generator=g) * 2 + 0.05,
                                                   torch.rand(256, generator=g) * 0.99 + 0.01,
                                                   torch.randint(0, 3, (256,), generator=g) * 50,
                                                   (torch.rand(256, generator=g) < 0.3) * 0.05, strict=True))]
    key = (torch.randn(256, 65536, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    rows = rows_of(params, list(range(256)), device=DEVICE)
    assert torch.equal(ours(key, rows), threshold_sorted(key, rows))
    assert torch.equal(sample(key, rows), sample(key.float(), rows))  # fp32 keys: the sort path
