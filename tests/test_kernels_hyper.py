"""The fused hyper-connection site (atlas_kernels.hyper) against the torch block on random inputs."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from atlas_kernels.hyper import hyper_site, split_sizes

from atlas.backends.cuda.layers import hyper_block

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def case(rows: int, hc: int, hidden: int, lowrank: int, combine: bool, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    width = hc * hidden
    streams = (torch.randn(rows, width, generator=gen) * 3).to(DEVICE, dtype)
    norm_w = (1 + 0.1 * torch.randn(width, generator=gen)).to(DEVICE, dtype)
    down_w = (torch.randn(lowrank + (hc if combine else 0), width, generator=gen) / width**0.5).to(DEVICE, dtype)
    up_w = (torch.randn(width, lowrank, generator=gen) / lowrank**0.5).to(DEVICE, dtype)
    return streams, norm_w, down_w, up_w


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any()
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden", "lowrank", "combine"),
                         [(1, 64, 40, True), (3, 128, 32, False), (20, 64, 24, True)])
def test_fused_site_matches_the_torch_block(dtype: torch.dtype, rows: int, hidden: int, lowrank: int,
                                            combine: bool) -> None:
    # lowrank 40 / 24: not a multiple of the k tile; 20 rows: the 64-row tiles
    hc, eps = 4, 1e-6
    streams, norm_w, down_w, up_w = case(rows, hc, hidden, lowrank, combine, dtype, seed=rows + hidden)
    mixed, inject = hyper_site(streams, norm_w, down_w, up_w, hc, lowrank, eps, combine)
    want_mixed, want_inject = hyper_block(streams.double(), norm_w.double(), down_w.double(), up_w.double(), hc,
                                          hidden, lowrank, eps, combine)
    assert mixed.dtype == dtype and mixed.shape == (rows, hidden)
    assert rel(mixed, want_mixed) < TOLERANCE[dtype]
    if combine:
        assert inject is not None and want_inject is not None and inject.shape == (rows, hc)
        assert rel(inject, want_inject) < TOLERANCE[dtype]
    else:
        assert inject is None


ON_GPU = torch.cuda.is_available()


# 16 rows at hidden 2048 only compiled: on the interpreter it runs the grids 1 row does (one 64-row GEMM tile,
# partly masked; norm tiles full or not as 1 and 64 rows have them) for 38 s of the suite's worker time
@pytest.mark.parametrize("hc", [2, 4])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 2048), *([(16, 2048)] if ON_GPU else []), (64, 2048),
                                              (2048 if ON_GPU else 256, 2048 if ON_GPU else 128)])
def test_benchmark_hidden_size_matches_the_torch_block(rows: int, hidden: int, hc: int) -> None:
    # hidden 2048 (the benchmark model's): 8 or 16 splits of 512 columns in the split-K mix-down; 2048 rows: 32
    # row tiles (only compiled: the interpreter takes 6 minutes a case at hidden 2048, passed once by hand, and
    # 39 s at hidden 128, so the CPU runs 256 rows = 4 row tiles at hidden 128); lowrank 96 (not a multiple of
    # the mix-up's 64-column k tile: its masks too)
    lowrank, eps, dtype = 96, 1e-6, torch.bfloat16
    streams, norm_w, down_w, up_w = case(rows, hc, hidden, lowrank, True, dtype, seed=rows * hc)
    mixed, inject = hyper_site(streams, norm_w, down_w, up_w, hc, lowrank, eps, True)
    want_mixed, want_inject = hyper_block(streams.double(), norm_w.double(), down_w.double(), up_w.double(), hc,
                                          hidden, lowrank, eps, True)
    assert mixed.shape == (rows, hidden) and inject is not None and inject.shape == (rows, hc)
    assert rel(mixed, want_mixed) < TOLERANCE[dtype]
    assert want_inject is not None and rel(inject, want_inject) < TOLERANCE[dtype]


def test_split_sizes_depend_on_the_hidden_size_alone() -> None:
    assert split_sizes(2048) == (512, 128)
    assert split_sizes(64) == (64, 64)
    assert split_sizes(48) == (16, 16)
    with pytest.raises(ValueError, match="divisible by 16"):
        split_sizes(40)


# hidden 1024 on the CPU: two 512-column splits still (2048 takes the interpreter 26 s; compiled on a GPU)
@pytest.mark.parametrize("hidden", [64, 2048 if ON_GPU else 1024])
def test_a_rows_result_does_not_depend_on_the_other_rows(hidden: int) -> None:
    # 100 rows: two 64-row tiles and 25 norm tiles; the row alone: one of each, mostly masked
    lowrank = 32
    streams, norm_w, down_w, up_w = case(100, 4, hidden, lowrank, True, torch.bfloat16, seed=3)
    batched = hyper_site(streams, norm_w, down_w, up_w, 4, lowrank, 1e-6, True)
    for row in (0, 70, 99):
        alone = hyper_site(streams[row:row + 1], norm_w, down_w, up_w, 4, lowrank, 1e-6, True)
        assert torch.equal(alone[0][0], batched[0][row]) and torch.equal(alone[1][0], batched[1][row])  # type: ignore[index]
