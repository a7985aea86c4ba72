"""atlas_kernels.reference against transformers' qwen4_exp functions: the references the kernels are tested
against must themselves compute transformers' math."""

from __future__ import annotations

import pytest
import torch
from atlas_kernels import reference as ref

hf = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def gdn_inputs(gen: torch.Generator, tokens: int, k_heads: int = 2, v_heads: int = 4, dk: int = 16, dv: int = 8):
    q = torch.randn(1, tokens, k_heads, dk, generator=gen)
    k = torch.randn(1, tokens, k_heads, dk, generator=gen)
    v = torch.randn(1, tokens, v_heads, dv, generator=gen)
    g = -torch.rand(1, tokens, v_heads, generator=gen)
    beta = torch.rand(1, tokens, v_heads, generator=gen)
    state = torch.randn(1, v_heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def test_gdn_recurrent_matches_transformers_recurrent_and_chunked() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta, state = gdn_inputs(gen, tokens=70)
    out, states = ref.gdn_recurrent(q[0], k[0], v[0], g[0], beta[0], state[0])
    for fn in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
        want_out, want_state = fn(q, k, v, g, beta, initial_state=state.clone(), output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
        assert rel_err(out, want_out[0]) < 1e-5
        assert rel_err(states[-1], want_state[0]) < 1e-5


def test_gdn_recurrent_intermediate_states_are_prefix_states() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v, g, beta, state = gdn_inputs(gen, tokens=5)
    _, states = ref.gdn_recurrent(q[0], k[0], v[0], g[0], beta[0], state[0])
    for n in range(1, 5):
        _, prefix_states = ref.gdn_recurrent(q[0, :n], k[0, :n], v[0, :n], g[0, :n], beta[0, :n], state[0])
        torch.testing.assert_close(states[n - 1], prefix_states[-1])


@pytest.mark.parametrize("tokens", [1, 3])
def test_conv_update_matches_transformers(tokens: int) -> None:
    gen = torch.Generator().manual_seed(3)
    channels, kernel_size = 12, 4
    x = torch.randn(1, channels, tokens, generator=gen)
    conv_state = torch.randn(1, channels, kernel_size, generator=gen)
    weight = torch.randn(channels, kernel_size, generator=gen)
    want_state = conv_state.clone()
    want = hf.causal_conv1d_update(x, want_state, weight, None, "silu")
    out, new_state = ref.causal_conv1d_update(x[0].T, conv_state[0], weight)
    assert rel_err(out.T, want[0]) < 1e-6
    torch.testing.assert_close(new_state, want_state[0])


def test_norms_match_transformers() -> None:
    gen = torch.Generator().manual_seed(4)
    x, gate = torch.randn(3, 32, generator=gen), torch.randn(3, 32, generator=gen)
    norm = hf.Qwen4ExpTextRMSNorm(32, eps=1e-6)
    gated = hf.Qwen4ExpTextRMSNormGated(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(generator=gen)
        gated.weight.normal_(generator=gen)
        assert rel_err(ref.rms_norm(x, norm.weight, 1e-6), norm(x)) < 1e-6
        assert rel_err(ref.gated_rms_norm(x, gate, gated.weight, 1e-6), gated(x, gate)) < 1e-6


def test_partial_rope_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(5)
    head_dim, positions = 32, torch.tensor([0, 4, 9, 1000])
    inv_freq = ref.rope_inv_freq(head_dim, 0.25, 10000.0)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x = torch.randn(1, 1, 4, head_dim, generator=gen)  # [batch, heads, positions, d]
    want = hf.apply_rotary_pos_emb(x, cos=cos[None], sin=sin[None])
    assert rel_err(ref.apply_rope(x, positions, inv_freq), want) < 1e-6
