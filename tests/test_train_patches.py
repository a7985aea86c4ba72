"""tools/train_patches.py and tools/mini_mtp.py: the training-speed replacements compute what transformers'
code computes (masks, logits, gradients), and the MTP head is Atlas's drafter (atlas/backends/cpu/mtp.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import train_patches
from mini_config import model_config
from mini_mtp import build_models, mtp_pairs

SEQ = 70  # past the tiny preset's inert bound (32 + 4 - 1), and not a multiple of the QSA ratio


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for this module: its ops are small, and a second thread only adds a barrier wait to each
    (on a loaded 2-core machine that wait made a 3-step run take 75 s instead of 12 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    """Every weight O(1)-scaled, norm weights included, so no path is inert (transformers zeroes norms)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.0, 1.5, generator=g))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def tiny():
    config = model_config("tiny", vocab_size=320)
    model, head = build_models(config, torch.device("cpu"))
    _randomise(model, 11)
    _randomise(head, 12)
    ids = torch.randint(4, 320, (2, SEQ), generator=torch.Generator().manual_seed(3))
    ids[0, 20] = 0  # EOS mid-sequence: the PLE n-gram context restarts
    return config, model.eval(), head.eval(), ids


def _forward_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(input_ids=ids, use_cache=False).logits
    g = torch.Generator().manual_seed(5)
    (logits * torch.randn(logits.shape, generator=g)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_patched_model_matches_transformers_logits_and_gradients(tiny):
    """GDN and experts patched: the same logits and gradients. (The indexer is checked on its own below: its
    top-k may break ties between equal block scores differently, which moves logits.)"""
    _, model, _, ids = tiny
    ref_logits, ref_grads = _forward_and_grads(model, ids)
    try:
        patched = train_patches.apply(indexer=False)
        logits, grads = _forward_and_grads(model, ids)
    finally:
        train_patches.restore()
    assert len(patched) == 2
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref.abs().max().item()), f"{name}: max |dgrad| {err:.2e}"
    # the indexer gets no gradient in either (its selection is a boolean mask)
    assert not any("indexer" in n for n in ref_grads)


def _block_scores(indexer, hidden: torch.Tensor, emb) -> torch.Tensor:
    """Every query's score for every complete block [B, T, blocks], the plain way (the test's own helper)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    cos, sin = emb
    b, t, _ = hidden.shape
    r, d, heads = indexer.compress_ratio, indexer.index_head_dim, indexer.index_n_heads
    q, raw = indexer.index_qk_proj(hidden).split([heads * d, d], -1)
    q = apply_rotary_pos_emb(indexer.q_layernorm(q.reshape(b, t, heads, d)), cos=cos, sin=sin, unsqueeze_dim=2)
    n = t // r
    pooled = indexer.k_layernorm(raw[:, : n * r].reshape(b, n, r, d).mean(2))
    starts = torch.arange(n) * r
    keys = apply_rotary_pos_emb(pooled[:, :, None], cos=cos[:, starts], sin=sin[:, starts], unsqueeze_dim=2)[:, :, 0]
    return torch.einsum("bthd,bnd->btnh", q, keys).relu().sum(-1) / d**0.5


def test_fast_indexer_selects_what_the_loop_selects(tiny):
    """Same tokens for every query, except that among blocks of EQUAL score (relu makes exact zeros common) the
    two top-k calls may keep different ones: then the kept scores must still be the same multiset."""
    config, model, _, _ = tiny
    from transformers.masking_utils import create_causal_mask

    attn_layer = next(layer for layer in model.model.layers if hasattr(layer, "self_attn"))
    indexer = attn_layer.self_attn.indexer
    ratio = indexer.compress_ratio
    original = train_patches._ORIGINALS.get("indexer", type(indexer).forward)
    g = torch.Generator().manual_seed(8)
    ties = 0
    for seq in (3, 4, 35, 36, 37, SEQ, 2 * SEQ):  # no block, one block, around the inert bound, sparse
        hidden = torch.randn(2, seq, config["hidden_size"], generator=g)
        positions = torch.arange(seq).view(1, 1, -1).expand(3, 2, -1)
        emb = model.model.rotary_emb(hidden, positions)
        mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=torch.arange(seq)[None].expand(2, -1), allow_is_causal_skip=False)
        with torch.no_grad():
            ref = original(indexer, hidden, emb, mask, None)
            fast = train_patches.fast_indexer_forward(indexer, hidden, emb, mask, None)
            scores = _block_scores(indexer, hidden, emb) if seq >= ratio else None
        assert fast.shape == ref.shape == (2, 1, seq, seq)
        assert torch.equal(fast.sum(-1), ref.sum(-1)), f"seq {seq}: token counts differ"
        for b, t in {(int(b), int(t)) for b, _, t, _ in (fast != ref).nonzero()}:
            complete = (t + 1) // ratio
            kept = [scores[b, t, i].item() for i in range(complete) for m in (ref, fast) if m[b, 0, t, i * ratio]]
            ref_kept = sorted(scores[b, t, i].item() for i in range(complete) if ref[b, 0, t, i * ratio])
            fast_kept = sorted(scores[b, t, i].item() for i in range(complete) if fast[b, 0, t, i * ratio])
            assert ref_kept == pytest.approx(fast_kept, abs=1e-6), f"seq {seq}, query {t}: not a tie"
            assert kept and torch.equal(ref[b, 0, t, complete * ratio :], fast[b, 0, t, complete * ratio :])
            ties += 1
        if seq > indexer.token_budget + ratio - 1:  # sparse: the test sees real selection
            assert int(ref[0, 0, -1].sum()) < seq
    assert ties < 40, f"{ties} queries differ: more than ties explain"


def test_dense_experts_match_eager(tiny):
    _, model, _, _ = tiny
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(9)
    x = torch.randn(50, experts.hidden_dim, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(50)])
    weights = torch.rand(50, 2, generator=g, requires_grad=True)
    ref = type(experts).forward(experts, x, index, weights)
    out = train_patches.dense_experts_forward(experts, x, index, weights)
    assert (out - ref).abs().max().item() < 1e-5
    gx_ref, gw_ref = torch.autograd.grad(ref.square().sum(), (x, weights))
    gx, gw = torch.autograd.grad(out.square().sum(), (x, weights))
    assert (gx - gx_ref).abs().max().item() < 1e-4 and (gw - gw_ref).abs().max().item() < 1e-4


def test_mtp_head_is_atlas_drafter(tiny):
    """The head trained here, saved under `mtp.`, gives Atlas's reference drafter logits (same weights)."""
    config, model, head, ids = tiny
    from atlas.backends.cpu.mtp import mtp_forward
    from atlas.model.spec import ModelSpec

    with torch.no_grad():
        hidden = model.model(input_ids=ids[:1], use_cache=False).last_hidden_state
        embed, pair_hidden = mtp_pairs(model.model.embed_tokens.weight, hidden, ids[:1])
        draft = head(embed, pair_hidden)
        ours = model.lm_head(draft)[0]
    spec = ModelSpec.from_config(model.config.to_dict())
    w = {"embed_tokens.weight": model.model.embed_tokens.weight.detach(),
         "lm_head.weight": model.lm_head.weight.detach(),
         **{"mtp." + k: v.detach() for k, v in head.state_dict().items()}}
    atlas_logits, atlas_hidden = mtp_forward(spec, w, hidden[0, :-1], ids[0, 1:])
    assert (atlas_logits - ours).abs().max().item() < 1e-4
    assert (atlas_hidden - draft[0]).abs().max().item() < 1e-4
    # and from a later first key (RoPE positions move with it)
    atlas_late, _ = mtp_forward(spec, w, hidden[0, 10:-1], ids[0, 11:], first_key=10)
    with torch.no_grad():
        late = model.lm_head(head(embed[:, 10:], pair_hidden[:, 10:], first_key=10))[0]
    assert (atlas_late - late).abs().max().item() < 1e-4


def test_router_balance_loss_is_transformers():
    from transformers.models.qwen4_exp.modeling_qwen4_exp import load_balancing_loss_func

    g = torch.Generator().manual_seed(4)
    logits = tuple(torch.randn(30, 6, generator=g) * 2 for _ in range(3))
    ours = train_patches.router_balance_loss(logits, 6, 2)
    assert abs(ours.item() - load_balancing_loss_func(logits, 6, 2).item()) < 1e-5
    # uniform router probabilities score top_k, whichever experts the ties pick
    uniform = (torch.zeros(12, 4),)
    assert train_patches.router_balance_loss(uniform, 4, 2).item() == pytest.approx(2.0)
