"""atlas_kernels.hyper_small (a hyper site at decode's few rows in two GEMV-shaped kernels) against the torch block."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from atlas_kernels.hyper_small import ROWS, fits, hyper_small, split_of
from test_kernels_hyper import case

from atlas.backends.cuda.layers import hyper_block

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1.5e-2}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any()
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hc", "hidden", "lowrank", "combine"),
                         [(1, 4, 512, 40, True), (3, 4, 1024, 24, False), (4, 2, 512, 64, True), (2, 4, 512, 320, True),
                          (1, 2, 64, 16, True), (2, 4, 528, 24, True)])
def test_the_small_site_matches_the_torch_block(dtype: torch.dtype, rows: int, hc: int, hidden: int, lowrank: int,
                                                combine: bool) -> None:
    # lowrank 40 / 24: not a multiple of the mix-up's k step; 3 rows: a padded row tile; 320: the benchmark model's;
    # hidden 64 (atlas-tiny) / 528: splits of 64 / 16 inputs
    eps = 1e-6
    streams, norm_w, down_w, up_w = case(rows, hc, hidden, lowrank, combine, dtype, seed=rows + hidden + lowrank)
    mixed, inject = hyper_small(streams, norm_w, down_w, up_w, hc, lowrank, eps, combine)
    want_mixed, want_inject = hyper_block(streams.double(), norm_w.double(), down_w.double(), up_w.double(), hc,
                                          hidden, lowrank, eps, combine)
    torch_mixed, _ = hyper_block(streams, norm_w, down_w, up_w, hc, hidden, lowrank, eps, combine)
    assert mixed.dtype == dtype and mixed.shape == (rows, hidden)
    assert rel(mixed, want_mixed) < TOLERANCE[dtype]
    # rounded where the torch form rounds: no further from the exact result than the torch form itself (+ slack)
    assert rel(mixed, want_mixed) < 1.5 * rel(torch_mixed, want_mixed) + 1e-7
    if combine:
        assert inject is not None and want_inject is not None and inject.shape == (rows, hc)
        assert rel(inject, want_inject) < TOLERANCE[dtype]
    else:
        assert inject is None
    lead = hyper_small(streams[None], norm_w, down_w, up_w, hc, lowrank, eps, combine)[0]
    assert lead.shape == (1, rows, hidden) and torch.equal(lead[0], mixed)


def test_a_row_alone_equals_the_same_row_among_others() -> None:
    """Batch invariance: every reduction is over fixed tiles per row, so row 2 alone gives row 2 of four bit for bit."""
    streams, norm_w, down_w, up_w = case(ROWS, 4, 512, 40, True, torch.bfloat16, seed=9)
    mixed, inject = hyper_small(streams, norm_w, down_w, up_w, 4, 40, 1e-6, True)
    alone, inject_alone = hyper_small(streams[2:3], norm_w, down_w, up_w, 4, 40, 1e-6, True)
    assert inject is not None and inject_alone is not None
    assert torch.equal(alone[0], mixed[2]) and torch.equal(inject_alone[0], inject[2])


def test_the_small_site_refuses_what_it_cannot_run() -> None:
    streams, norm_w, down_w, up_w = case(ROWS + 1, 4, 512, 40, True, torch.float32, seed=1)
    assert not fits(ROWS + 1, 4, 512) and not fits(1, 4, 520) and not fits(1, 3, 512) and fits(1, 4, 512)
    assert split_of(2048) == 512 and split_of(64) == 64 and split_of(528) == 16
    with pytest.raises(ValueError, match="rows"):
        hyper_small(streams, norm_w, down_w, up_w, 4, 40, 1e-6, True)
    with pytest.raises(ValueError, match="down_w"):
        hyper_small(streams[:1], norm_w, down_w[:40], up_w, 4, 40, 1e-6, True)


def test_the_op_is_the_function() -> None:
    """torch.ops.atlas.hyper_small (what a compiled decode region calls) gives hyper_small's tensors; its injection is
    [.., 0] when the site does not combine."""
    streams, norm_w, down_w, up_w = case(2, 4, 512, 40, False, torch.float32, seed=3)
    mixed, inject = torch.ops.atlas.hyper_small(streams, norm_w, down_w, up_w, 4, 40, 1e-6, False)
    assert torch.equal(mixed, hyper_small(streams, norm_w, down_w, up_w, 4, 40, 1e-6, False)[0])
    assert inject.shape == (2, 0)
