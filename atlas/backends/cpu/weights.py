"""Products that share an input, as one product over their weights joined by rows.

On a model as small as atlas-mini a step's time is mostly the count of torch calls, so a layer whose input
feeds several projections runs them as one: GDN's q/k/v, z, b and a; attention's q, k, v and the QSA index
projection; a hyper-connection's mix-down and inject weights; MoE's router, shared expert gate/up and its gate;
PLE's key and value projections; a dense MLP's gate and up (and the MTP drafter's two input norms, one
grouped norm). Each output column of a product reads only its own weight row, and the
one-row products and their batched forms (atlas.backends.cpu.rows) give every column the same bits whether its
row stands alone or in a joined weight (checked on atlas-mini's and atlas-tiny's shapes, tests/test_spec_rows.py).

`join_weights` adds the joined weights to a copy of the weights at load (the parts stay, for readers that
want them); `joined` reads one, or joins the parts on the spot for weights that were never prepared (the
stateless references' callers pass a checkpoint's dict).
"""

from __future__ import annotations

import torch

from atlas.model.spec import FULL_ATTENTION, ModelSpec

GDN_IN = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
ATTENTION_IN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "indexer.index_qk_proj.weight")
HYPER_DOWN = ("input_mix_weight_down.weight", "block_inject_weight.weight")
MOE_IN = ("gate.weight", "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
          "shared_expert_gate.weight")
PLE_IN = ("key_proj.weight", "value_proj.weight")
DENSE_IN = ("gate_proj.weight", "up_proj.weight")
PRE_FC_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")  # the MTP drafter's input norms


def _key(pre: str, parts: tuple[str, ...]) -> str:
    return pre + "joined(" + ",".join(parts) + ")"


def _parts(w: dict[str, torch.Tensor], pre: str, parts: tuple[str, ...]) -> list[torch.Tensor]:
    return [w[pre + p] for p in parts if pre + p in w]


def joined(w: dict[str, torch.Tensor], pre: str, parts: tuple[str, ...]) -> tuple[torch.Tensor, list[int]]:
    """(the weights `pre` + parts present, joined by rows [sum N, K], each part's N)."""
    got = w.get(_key(pre, parts))
    present = _parts(w, pre, parts)
    sizes = [t.shape[0] for t in present]
    if got is None:
        got = present[0] if len(present) == 1 else torch.cat(present)
    return got, sizes


def join_weights(spec: ModelSpec, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `w` with every joined weight the CPU layers read (the parts kept)."""
    out = dict(w)

    def add(pre: str, parts: tuple[str, ...]) -> None:
        present = _parts(w, pre, parts)
        if len(present) > 1:
            out[_key(pre, parts)] = torch.cat(present).contiguous()

    hypers = ("attn_hyper_connection.", "mlp_hyper_connection.")
    for prefix, layer_types in (("layers.", spec.layer_types),
                                ("mtp.layers.", [FULL_ATTENTION] * spec.mtp_num_layers)):
        for layer, kind in enumerate(layer_types):
            pre = f"{prefix}{layer}."
            if kind == FULL_ATTENTION:
                add(pre + "self_attn.", ATTENTION_IN)
            else:
                add(pre + "linear_attn.", GDN_IN)
            for hc in hypers:
                add(pre + hc, HYPER_DOWN)
            add(pre + "mlp.", MOE_IN)
            add(pre + "mlp.", DENSE_IN)
            add(pre + "ple.", PLE_IN)
    add("hyper_connection_mixer.", HYPER_DOWN)
    add("mtp.", PRE_FC_NORMS)
    return out
