"""Causal conv1d update and the fused RMSNorms against the plain-torch reference (interpreted without a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from atlas_kernels import reference as ref
from atlas_kernels.conv import causal_conv1d_update
from atlas_kernels.norms import gated_rms_norm, rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any(), "NaN in the kernel's output"
    return float((got.double() - want.double()).norm() / want.double().norm())


def check_conv(channels: int, kernel_size: int, state_len: int, tokens: int, dtype: torch.dtype,
               bias: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    x = randn(3, tokens, channels)
    weight, bias_t = randn(channels, kernel_size), randn(channels) if bias else None
    pool = randn(5, channels, state_len)
    before = pool.clone()
    slots = torch.tensor([4, 0, 2], device=DEVICE)

    out = causal_conv1d_update(x, pool, slots, weight, bias_t, block_c=64)

    assert out.dtype == dtype
    for n in range(3):
        want, want_state = ref.causal_conv1d_update(x[n], before[slots[n]], weight, bias_t)
        assert rel_err(out[n], want) < TOLERANCE[dtype]
        # the state is a copy of input columns, so it must be exact
        assert torch.equal(pool[slots[n]], want_state.to(dtype))
    for untouched in (1, 3):
        assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("state_len", "tokens"), [(4, 1), (4, 5), (3, 2), (3, 6)])
def test_conv_update_matches_reference(dtype: torch.dtype, state_len: int, tokens: int) -> None:
    check_conv(100, 4, state_len, tokens, dtype, bias=state_len == 3, seed=state_len * 10 + tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 128), (2, 3, 48), (2, 2048)])
def test_norms_match_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    gate = torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    weight = (0.3 * torch.randn(shape[-1], generator=gen)).to(DEVICE)

    normed, gated = rms_norm(x, weight, 1e-6), gated_rms_norm(x, gate, weight, 1e-6)

    assert normed.dtype == gated.dtype == dtype and normed.shape == gated.shape == x.shape
    assert rel_err(normed, ref.rms_norm(x, weight, 1e-6)) < TOLERANCE[dtype]
    assert rel_err(gated, ref.gated_rms_norm(x, gate, weight, 1e-6)) < TOLERANCE[dtype]


@cuda
@pytest.mark.cuda
def test_benchmark_shapes_on_gpu() -> None:
    """GDN conv of qwen4exp-2p7b: 2 * 16 * 128 + 32 * 128 = 8192 channels, K = 4, verify of 4 tokens."""
    check_conv(8192, 4, 4, 4, torch.bfloat16, bias=False, seed=1)
    check_conv(8192, 4, 4, 1, torch.float32, bias=False, seed=2)
