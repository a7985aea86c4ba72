"""The grouped MoE kernel (atlas_kernels.moe_grouped) against a plain per-row loop on random inputs."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from atlas_kernels.moe_grouped import moe_grouped, moe_route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def reference(x, top_i, top_w, gate_up, down):  # type: ignore[no-untyped-def]
    x, gate_up, down, top_w = x.double(), gate_up.double(), down.double(), top_w.double()
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for k in range(top_i.shape[1]):
            g, u = (gate_up[top_i[r, k]] @ x[r]).chunk(2)
            out[r] += top_w[r, k] * (down[top_i[r, k]] @ (torch.nn.functional.silu(g) * u))
    return out


def random_case(rows: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    logits = torch.randn(rows, experts, generator=gen)
    top_w, top_i = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, top_i.to(DEVICE), top_w.to(DEVICE, dtype), gate_up, down


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any(), "NaN in the kernel's output"
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden", "inter"), [(1, 64, 32), (5, 96, 48), (70, 64, 32)])
def test_grouped_moe_matches_the_loop(dtype: torch.dtype, rows: int, hidden: int, inter: int) -> None:
    # 96 / 48: sizes that are not a multiple of the tiles (masked columns); 70 rows: the prefill tiles
    x, top_i, top_w, gate_up, down = random_case(rows, hidden, inter, 8, 3, dtype, seed=rows + hidden)
    got = moe_grouped(x, top_i, top_w, gate_up, down)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel_err(got, reference(x, top_i, top_w, gate_up, down)) < TOLERANCE[dtype]


def test_routing_lists_each_experts_pairs_in_order() -> None:
    top_i = torch.tensor([[3, 0], [0, 2], [3, 1]], device=DEVICE)
    order, offsets = moe_route(top_i, 5)
    assert offsets.tolist() == [0, 2, 3, 4, 6, 6]  # expert 4: nobody
    assert order.tolist() == [1, 2, 5, 3, 0, 4]  # pairs r*K + k, expert by expert, stable within one


def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    # the decode tiles (16 rows): row 0 alone, and row 0 among 40 others, must agree bit for bit
    x, top_i, top_w, gate_up, down = random_case(41, 64, 32, 8, 3, torch.bfloat16, seed=7)
    alone = moe_grouped(x[:1], top_i[:1], top_w[:1], gate_up, down)
    batched = moe_grouped(x, top_i, top_w, gate_up, down)
    assert torch.equal(alone[0], batched[0])


@pytest.mark.parametrize("stages", [None, 3])
def test_a_counted_route_and_the_pipeline_depth_change_nothing(stages: int | None) -> None:
    from atlas.backends.cuda.moe import counted_route

    x, top_i, top_w, gate_up, down = random_case(5, 64, 32, 8, 3, torch.float32, seed=11)
    want = moe_grouped(x, top_i, top_w, gate_up, down)
    got = moe_grouped(x, top_i, top_w, gate_up, down, route=counted_route(top_i, 8), stages=stages)
    assert torch.equal(got, want)


@pytest.mark.parametrize("down_tile", [(32, 16, 4, None), (64, 32, 8, 3)])
def test_the_down_kernels_own_tile_keeps_the_result(down_tile: tuple[int, int, int, int | None]) -> None:
    """moe_grouped(down_tile=...) (benchmarks/kernels.py's PREFILL_MOE_DOWN_TILES): the down kernel on its own column
    tile, k step, warps and stages gives the shared tile's result within fp32 rounding (the dot's shape may change
    the order of its sums, here numpy's, on a GPU the MMA's), and a wrong tile wiring (columns skipped or doubled)
    would be far off."""
    x, top_i, top_w, gate_up, down = random_case(70, 64, 48, 8, 3, torch.float32, seed=12)
    want = moe_grouped(x, top_i, top_w, gate_up, down, blocks=(64, 16, 16))
    got = moe_grouped(x, top_i, top_w, gate_up, down, blocks=(64, 16, 16), down_tile=down_tile)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
