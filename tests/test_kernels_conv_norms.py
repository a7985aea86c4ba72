"""Causal conv1d update and the fused RMSNorms against the plain-torch reference (interpreted without a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from atlas_kernels import reference as ref
from atlas_kernels.conv import causal_conv1d_update, causal_conv_prefill
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


@pytest.mark.parametrize("schedule", ["tiles", "tiles-8x128-w2", "rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dilation", "state_len", "tokens"), [(1, 3, 70), (1, 4, 2), (3, 9, 40), (3, 9, 5)])
def test_prefill_conv_equals_the_windowed_product_on_strided_input(dtype: torch.dtype, dilation: int, state_len: int,
                                                                    tokens: int, schedule: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """causal_conv_prefill on a token-strided slice of a wider projection (as the GDN heads feed it) against the CUDA
    backend's windowed conv_step (channel-major) then F.silu, in either kernel form: tile boundaries (70 tokens in
    16-, 32- or 64-token tiles: the first tile reads the state, the others x only), fewer tokens than the state (the
    taps reaching into the state past the first tile), PLE's dilation 3."""
    from atlas_kernels import conv

    from atlas.backends.cuda.primitives import conv_step

    monkeypatch.setattr(conv, "PREFILL_SCHEDULE", schedule)
    gen = torch.Generator().manual_seed(dilation * 100 + tokens)
    channels, k = 136, 4  # a partial channel tile
    proj = torch.randn(2, tokens, channels + 40, generator=gen).to(DEVICE, dtype)
    x = proj[..., 24 : 24 + channels]
    prev = torch.randn(2, channels, state_len, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(channels, 1, k, generator=gen).to(DEVICE, dtype)

    got = causal_conv_prefill(x, prev, weight, dilation, True)

    want, _ = conv_step(prev, x.transpose(1, 2), weight, dilation)
    want = torch.nn.functional.silu(want).transpose(1, 2)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    assert rel_err(got, want) < {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    plain = causal_conv_prefill(x, prev, weight, dilation, False)
    want_plain, _ = conv_step(prev, x.transpose(1, 2), weight, dilation)
    assert rel_err(plain, want_plain.transpose(1, 2)) < {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]


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


def test_prefill_conv_traces_whole_as_an_opaque_op_with_a_symbolic_token_dimension() -> None:
    """The compiled prefill regions call causal_conv_prefill as a custom op: Dynamo (fullgraph, the token dimension
    marked dynamic as regions._token_dim does) and AOT autograd's fake run (register_fake) take it whole, and it
    gives the eager call's values."""
    gen = torch.Generator().manual_seed(5)
    prev = torch.randn(1, 40, 3, generator=gen).to(DEVICE)
    weight = torch.randn(40, 1, 4, generator=gen).to(DEVICE)

    def region(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.atlas.causal_conv_prefill(x[..., 8:48], prev, weight, 1, True) * 2.0

    compiled = torch.compile(region, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    for tokens in (37, 64):
        x = torch.randn(1, tokens, 56, generator=gen).to(DEVICE)
        torch._dynamo.mark_dynamic(x, 1)
        assert torch.allclose(compiled(x), region(x))
