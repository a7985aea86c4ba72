"""atlas_kernels.moe_small (the routed experts at decode's few rows, GEMV-shaped) against a plain per-row loop and
against moe_grouped on random inputs."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from atlas_kernels.moe_grouped import moe_grouped, moe_route
from atlas_kernels.moe_small import ROWS, fits, moe_small
from test_kernels_moe import TOLERANCE, random_case, reference, rel_err

from atlas.backends.cuda.moe import counted_route


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden", "inter", "experts", "top_k"),
                         [(1, 256, 96, 8, 2), (3, 200, 64, 8, 4), (4, 256, 160, 4, 4), (2, 64, 16, 16, 4)])
def test_the_small_experts_match_the_loop(dtype: torch.dtype, rows: int, hidden: int, inter: int, experts: int,
                                          top_k: int) -> None:
    # hidden 200 / inter 96, 160: not multiples of the k steps or the column tiles; 4 rows of 4 experts, top 4: every
    # expert holds a pair of every row (the most pairs an expert can hold)
    x, top_i, top_w, gate_up, down = random_case(rows, hidden, inter, experts, top_k, dtype, seed=rows * hidden + inter)
    got = moe_small(x, top_i, top_w, gate_up, down)
    assert got.dtype == dtype and got.shape == (rows, hidden)
    assert rel_err(got, reference(x, top_i, top_w, gate_up, down)) < TOLERANCE[dtype]
    grouped = moe_grouped(x, top_i, top_w, gate_up, down, summed=False)
    pairs = moe_small(x, top_i, top_w, gate_up, down, summed=False)
    assert pairs.shape == (rows, top_k, hidden)
    assert rel_err(pairs, grouped.double()) < TOLERANCE[dtype]


def test_a_counted_route_gives_the_same_outputs() -> None:
    x, top_i, top_w, gate_up, down = random_case(3, 128, 48, 8, 2, torch.float32, seed=4)
    want = moe_small(x, top_i, top_w, gate_up, down, summed=False)
    assert torch.equal(moe_small(x, top_i, top_w, gate_up, down, route=moe_route(top_i, 8), summed=False), want)
    assert torch.equal(moe_small(x, top_i, top_w, gate_up, down, route=counted_route(top_i, 8, ranked=True),
                                 summed=False), want)


def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    x, top_i, top_w, gate_up, down = random_case(ROWS, 128, 48, 8, 2, torch.bfloat16, seed=6)
    together = moe_small(x, top_i, top_w, gate_up, down)
    alone = moe_small(x[1:2], top_i[1:2], top_w[1:2], gate_up, down)
    assert torch.equal(alone[0], together[1])


def test_the_small_experts_refuse_what_they_cannot_run() -> None:
    assert fits(1) and fits(ROWS) and not fits(ROWS + 1) and not fits(0)
    x, top_i, top_w, gate_up, down = random_case(ROWS + 1, 64, 16, 8, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="rows"):
        moe_small(x, top_i, top_w, gate_up, down)
    with pytest.raises(ValueError, match="disagree"):
        moe_small(x[:2], top_i[:2], top_w[:2], gate_up, down[:, :32])
