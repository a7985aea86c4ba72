"""The weights in the shapes the CUDA backend's batched forward wants (prepare_weights)."""

from __future__ import annotations

import torch

from atlas.backends.ops import acc_dtype
from atlas.model.spec import FULL_ATTENTION, ModelSpec


def prepare_weights(spec: ModelSpec, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights in the shapes the batched forward wants (a decode step is launch-bound: every kernel saved
    counts). One GEMM where the reference runs several over the same input: GDN's four input projections,
    attention's q/k/v (+ QSA index) projections, a hyper-connection's mix-down and inject weights (with their
    common 1/hc folded in), MoE's router + shared-expert gate/up + its gate; the parts are dropped, so no
    weight is held twice. Zero-centred norm weights become plain scales (1 + w); GDN's A_log becomes
    -exp(A_log) in fp32."""
    w = dict(w)

    def fuse(name: str, parts: list[str], align: int = 1) -> None:
        present = [p for p in parts if p in w]
        fused = torch.cat([w.pop(p) for p in present], dim=0)
        pad = -fused.shape[0] % align
        if pad:  # zero rows: the product's extra columns are dropped (split_out)
            fused = torch.cat([fused, fused.new_zeros(pad, *fused.shape[1:])])
        w[name] = fused.contiguous()

    acc = acc_dtype(next(iter(w.values())).dtype)
    for name in [n for n in w if _is_zero_centred_norm(n)]:
        w[name] = (1.0 + w[name].to(acc)).to(w[name].dtype)  # now a plain RMSNorm scale: one op fewer per norm
    for layer in range(spec.num_layers):
        pre = f"layers.{layer}."
        if spec.layer_types[layer] != FULL_ATTENTION:  # the decay's constant factor, once
            g = pre + "linear_attn."
            w[g + "neg_exp_A"] = -w[g + "A_log"].to(acc).exp()
            w[g + "dt_bias"] = w[g + "dt_bias"].to(acc)
        if spec.layer_types[layer] == FULL_ATTENTION:
            a = pre + "self_attn."
            fuse(a + "fused_in.weight", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight",
                                         a + "indexer.index_qk_proj.weight"])
        else:
            g = pre + "linear_attn."
            fuse(g + "fused_in.weight", [g + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")])
        if spec.has_hyper_connections:
            for hc in ("attn_hyper_connection.", "mlp_hyper_connection."):
                fuse(pre + hc + "fused_down.weight", [pre + hc + "input_mix_weight_down.weight",
                                                      pre + hc + "block_inject_weight.weight"], ALIGN_ROWS)
                w[pre + hc + "fused_down.weight"] /= spec.hc_count  # both products are divided by hc: fold it
        m = pre + "mlp."
        if spec.moe_layers[layer] and spec.moe is not None:
            fuse(m + "fused_in.weight", [m + "gate.weight", m + "shared_expert.gate_proj.weight",
                                         m + "shared_expert.up_proj.weight", m + "shared_expert_gate.weight"],
                 ALIGN_ROWS)
    if spec.has_hyper_connections:
        w["hyper_connection_mixer.input_mix_weight_down.weight"] = (
            w["hyper_connection_mixer.input_mix_weight_down.weight"] / spec.hc_count)
    return w


# fused weights padded to a multiple of this many output rows (zeros): a product whose output rows are not 16-byte
# aligned cannot take cuBLAS's sm90 kernels. H200, unpadded: the hyper mix-down + inject (324 columns) ran as
# cutlass_80 s16816 GEMMs (48 a step, 7.6 us each at batch 64, 55 us at 2,048 tokens) and the MoE router + shared
# expert input (1,041 columns) as cutlass_75 s1688 (12.2 us at batch 64, 133 us at 2,048 tokens)
ALIGN_ROWS = 8


def _is_zero_centred_norm(name: str) -> bool:
    # every RMSNorm weight but GDN's gated output norm is zero-centred: x * rsqrt(mean(x^2) + eps) * (1 + w)
    ends = ("norm.weight", "layernorm.weight", "norm_key.weight", "norm_query.weight", "norm_conv.weight")
    return name.endswith(ends) and not name.endswith("linear_attn.norm.weight")
