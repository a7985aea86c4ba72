"""tools/fast_gdn.py (the training GDN) against the token-by-token recurrence: outputs, final state, gradients."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from fast_gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for this module: its ops are small, and a second thread only adds a barrier wait to each
    (on a loaded 2-core machine that wait made a 3-step run take 75 s instead of 12 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _inputs(seed: int, b: int = 2, t: int = 37, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6,
            dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "query": torch.randn(b, t, hk, dk, generator=g, dtype=dtype),
        "key": torch.randn(b, t, hk, dk, generator=g, dtype=dtype),
        "value": torch.randn(b, t, hv, dv, generator=g, dtype=dtype),
        # log decays as the model makes them (-exp(A_log) softplus(.)), some near 0 and some strong
        "g": -torch.rand(b, t, hv, generator=g, dtype=dtype) * 2.0,
        "beta": torch.rand(b, t, hv, generator=g, dtype=dtype),
        "initial_state": 0.5 * torch.randn(b, hv, dk, dv, generator=g, dtype=dtype),
    }


def _run(fn, inputs: dict[str, torch.Tensor], **kw) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    out, state = fn(**leaves, use_qk_l2norm_in_kernel=True, **kw)
    g = torch.Generator().manual_seed(99)
    # a loss that weighs every output element and every state element differently
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum() + (
        state * torch.randn(state.shape, generator=g, dtype=state.dtype)).sum()
    loss.backward()
    return out.detach(), state.detach(), {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("chunk_size", [8, 16, 64])
def test_chunked_matches_recurrence_forward_state_and_gradients(chunk_size):
    inputs = _inputs(seed=chunk_size)
    ref_out, ref_state, ref_grads = _run(recurrent_gated_delta_rule, inputs)
    out, state, grads = _run(chunk_gated_delta_rule, inputs, chunk_size=chunk_size, output_final_state=True)
    assert out.dtype == torch.float64 and state.dtype == torch.float64
    assert (out - ref_out).abs().max().item() < 1e-10
    assert (state - ref_state).abs().max().item() < 1e-10
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert err < 1e-9 * max(1.0, scale), f"d/d{name}: max error {err:.3e} (scale {scale:.3e})"


def test_without_initial_state_and_against_transformers_in_fp32():
    """fp32 as training runs it, against transformers' own chunked and recurrent torch paths."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    inputs = {k: v.float() for k, v in _inputs(seed=3, t=70).items() if k != "initial_state"}
    out, state = chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(**inputs, output_final_state=True,
                                                             use_qk_l2norm_in_kernel=True)
    hf_out, hf_state = hf.torch_chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert (out - ref_out).abs().max().item() < 1e-5
    assert (state - ref_state).abs().max().item() < 1e-5
    assert (out - hf_out).abs().max().item() < 1e-5
    assert (state - hf_state).abs().max().item() < 1e-5


def test_state_carries_across_calls():
    """Two halves with the state handed over equal one call over the whole sequence (prefill continuation)."""
    inputs = _inputs(seed=5, t=40)
    whole, whole_state = chunk_gated_delta_rule(**inputs, chunk_size=16, output_final_state=True)
    first = {k: (v[:, :23] if k != "initial_state" else v) for k, v in inputs.items()}
    out1, mid = chunk_gated_delta_rule(**first, chunk_size=16, output_final_state=True)
    second = {k: v[:, 23:] for k, v in inputs.items() if k != "initial_state"}
    out2, end = chunk_gated_delta_rule(**second, initial_state=mid, chunk_size=16, output_final_state=True)
    assert (torch.cat([out1, out2], dim=1) - whole).abs().max().item() < 1e-10
    assert (end - whole_state).abs().max().item() < 1e-10


def test_bf16_inputs_under_autocast_keep_fp32_math():
    inputs = {k: v.to(torch.bfloat16) for k, v in _inputs(seed=8, t=33).items()}
    ref_out, _ = recurrent_gated_delta_rule(**{k: v.double() for k, v in inputs.items()},
                                            use_qk_l2norm_in_kernel=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, state = chunk_gated_delta_rule(**inputs, chunk_size=16, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    # bf16 rounding of the output only (8 bits of mantissa), not of the intermediate products
    assert (out.double() - ref_out).abs().max().item() < 2e-2


def test_varlen_is_refused():
    inputs = _inputs(seed=1, t=8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(**inputs, cu_seqlens=torch.tensor([0, 4, 8]))
