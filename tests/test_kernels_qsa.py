"""QSA indexer kernels: pooled block keys, block scores, top-k selection with deterministic ties, and the
whole path checked against transformers' Qwen4ExpTextQSAIndexer."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from atlas_kernels import reference as ref
from atlas_kernels.qsa import qsa_block_scores, qsa_pool_keys, qsa_select

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any(), "NaN in the kernel's output"
    return float((got.double() - want.double()).norm() / want.double().norm())


def paged_raw_keys(gen: torch.Generator, raw: list[torch.Tensor], block_size: int, ratio: int, dtype: torch.dtype):
    """Scatter each sequence's raw keys [n, d] into shuffled pages; pooled pool starts as NaN (poison)."""
    head_dim = raw[0].shape[-1]
    pages_per_seq = max(-(-r.shape[0] // block_size) for r in raw)
    num_pages = len(raw) * pages_per_seq + 2
    block_tables = torch.randperm(num_pages, generator=gen)[: len(raw) * pages_per_seq]
    block_tables = block_tables.view(len(raw), pages_per_seq).to(torch.int32)
    raw_pool = torch.randn(num_pages, block_size, head_dim, generator=gen)
    for b, keys in enumerate(raw):
        positions = torch.arange(keys.shape[0])
        raw_pool[block_tables[b, positions // block_size].long(), positions % block_size] = keys
    pooled_pool = torch.full((num_pages, block_size // ratio, head_dim), float("nan"))
    return raw_pool.to(DEVICE, dtype), pooled_pool.to(DEVICE, dtype), block_tables.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_and_score_match_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    seq_lens, index_heads, head_dim, ratio, block_size, rows = [37, 5, 61], 5, 64, 4, 8, 2
    raw = [torch.randn(n, head_dim, generator=gen) for n in seq_lens]
    raw_pool, pooled_pool, block_tables = paged_raw_keys(gen, raw, block_size, ratio, dtype)
    norm_weight = (0.2 * torch.randn(head_dim, generator=gen)).to(DEVICE)
    inv_freq = ref.rope_inv_freq(head_dim, 0.25, 10000.0).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    complete = lens // ratio
    # two calls, as blocks complete over steps: blocks [0, 3), then the rest
    first_end = torch.minimum(complete, torch.tensor(3, device=DEVICE)).to(torch.int32)
    qsa_pool_keys(raw_pool, pooled_pool, block_tables, torch.zeros_like(lens), first_end, norm_weight, inv_freq,
                  ratio, 1e-6, max_new_blocks=3, block_j=4)
    qsa_pool_keys(raw_pool, pooled_pool, block_tables, first_end, complete.to(torch.int32), norm_weight,
                  inv_freq, ratio, 1e-6, max_new_blocks=int(complete.max()), block_j=4)
    q = torch.randn(len(seq_lens), rows, index_heads, head_dim, generator=gen).to(DEVICE, dtype)

    scores = qsa_block_scores(q, pooled_pool, block_tables, lens, ratio, max_blocks=16, block_b=16)

    per_page = block_size // ratio
    for b, n in enumerate(seq_lens):
        want_keys = ref.qsa_pool_keys(raw[b].to(DEVICE, dtype), norm_weight, inv_freq, ratio, 1e-6)
        blocks = torch.arange(n // ratio, device=DEVICE)
        got_keys = pooled_pool[block_tables[b, blocks // per_page].long(), blocks % per_page]
        assert rel_err(got_keys, want_keys) < TOLERANCE[dtype]
        for t in range(rows):
            visible = (n - rows + t + 1) // ratio
            want_scores = ref.qsa_block_scores(q[b, t], want_keys[:visible])
            assert rel_err(scores[b, t, :visible], want_scores) < TOLERANCE[dtype]
            assert torch.isneginf(scores[b, t, visible:]).all()


@pytest.mark.parametrize("budget", [8, 16, 64])
def test_select_breaks_ties_to_the_lowest_block_like_the_reference(budget: int) -> None:
    gen = torch.Generator().manual_seed(budget)
    ratio, rows, seq_lens = 4, 3, [37, 5, 61, 4]
    # scores rounded to integers: many exact ties, most of them at relu's 0
    scores = torch.relu(torch.randn(len(seq_lens), rows, 16, generator=gen)).round()
    for b, n in enumerate(seq_lens):
        for t in range(rows):
            scores[b, t, (n - rows + t + 1) // ratio :] = float("-inf")
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    selected, counts = qsa_select(scores.to(DEVICE), lens.to(DEVICE), ratio, budget)

    assert selected.shape == (len(seq_lens), rows, budget + ratio - 1)
    for b, n in enumerate(seq_lens):
        for t in range(rows):
            visible = n - rows + t + 1
            want = ref.qsa_select(scores[b, t, : visible // ratio], visible, ratio, budget)
            assert int(counts[b, t]) == want.numel()
            assert torch.equal(selected[b, t, : want.numel()].cpu(), want)
            assert (selected[b, t, want.numel() :] == -1).all()


def test_whole_indexer_path_matches_transformers() -> None:
    """Raw keys -> pooled keys -> scores -> selection gives transformers' selected-token mask, row by row."""
    hf = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    torch.manual_seed(0)
    config = Qwen4ExpTextConfig(
        hidden_size=64, head_dim=32, indexer_head_dim=32, indexer_n_heads=4, indexer_kv_heads=1,
        indexer_budget=16, indexer_compress_ratio=4, num_attention_heads=2, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    indexer = hf.Qwen4ExpTextQSAIndexer(config, layer_idx=0).eval()
    with torch.no_grad():
        indexer.q_layernorm.weight.normal_(std=0.2)
        indexer.k_layernorm.weight.normal_(std=0.2)
    length, ratio, heads, head_dim = 45, 4, 4, 32
    hidden = torch.randn(1, length, 64)
    positions = torch.arange(length)
    cos, sin = hf.Qwen4ExpTextRotaryEmbedding(config)(hidden, positions[None])
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        want_mask = indexer(hidden, (cos, sin), causal, None)[0, 0]
        qk = indexer.index_qk_proj(hidden)[0]
        q = indexer.q_layernorm(qk[:, : heads * head_dim].view(length, heads, head_dim))
    inv_freq = ref.rope_inv_freq(head_dim, 0.25, 10000.0)
    q = ref.apply_rope(q.transpose(0, 1), positions, inv_freq).transpose(0, 1)  # [length, heads, d]
    raw = qk[:, heads * head_dim :].detach()

    gen = torch.Generator().manual_seed(2)
    raw_pool, pooled_pool, block_tables = paged_raw_keys(gen, [raw], 8, ratio, torch.float32)
    lens = torch.tensor([length], dtype=torch.int32, device=DEVICE)
    num_blocks = length // ratio
    qsa_pool_keys(raw_pool, pooled_pool, block_tables, torch.zeros_like(lens), lens // ratio,
                  indexer.k_layernorm.weight.detach().to(DEVICE), inv_freq.to(DEVICE), ratio, config.rms_norm_eps,
                  max_new_blocks=num_blocks)
    # every position as a row of one sequence: row t sees t + 1 tokens
    scores = qsa_block_scores(q[None].to(DEVICE), pooled_pool, block_tables, lens, ratio, num_blocks)
    selected, counts = qsa_select(scores, lens, ratio, config.indexer_budget)

    got_mask = torch.zeros(length, length, dtype=torch.bool)
    for t in range(length):
        got_mask[t, selected[0, t, : counts[0, t]].long().cpu()] = True
    assert torch.equal(got_mask, want_mask)
    assert int(want_mask[-1].sum()) == config.indexer_budget + length % ratio  # blocks really were dropped


@cuda
@pytest.mark.cuda
def test_benchmark_shapes_on_gpu() -> None:
    """qwen4exp-2p7b indexer: 8 heads of 128, ratio 4, budget 2048, rotary 32; 8192 tokens, 4 verify rows."""
    gen = torch.Generator().manual_seed(3)
    length, ratio, block_size, rows = 8192, 4, 16, 4
    raw = [torch.randn(length, 128, generator=gen)]
    raw_pool, pooled_pool, block_tables = paged_raw_keys(gen, raw, block_size, ratio, torch.bfloat16)
    norm_weight = (0.2 * torch.randn(128, generator=gen)).to(DEVICE)
    inv_freq = ref.rope_inv_freq(128, 0.25, 1e6).to(DEVICE)
    lens = torch.tensor([length], dtype=torch.int32, device=DEVICE)
    qsa_pool_keys(raw_pool, pooled_pool, block_tables, torch.zeros_like(lens), lens // ratio, norm_weight,
                  inv_freq, ratio, 1e-6, max_new_blocks=length // ratio)
    q = torch.randn(1, rows, 8, 128, generator=gen).to(DEVICE, torch.bfloat16)
    scores = qsa_block_scores(q, pooled_pool, block_tables, lens, ratio, length // ratio)
    want_keys = ref.qsa_pool_keys(raw[0].to(DEVICE, torch.bfloat16), norm_weight, inv_freq, ratio, 1e-6)
    blocks = torch.arange(length // ratio, device=DEVICE)
    got_keys = pooled_pool[block_tables[0, blocks // (block_size // ratio)].long(), blocks % (block_size // ratio)]
    assert rel_err(got_keys, want_keys) < TOLERANCE[torch.bfloat16]
    for t in range(rows):
        visible = (length - rows + t + 1) // ratio
        assert rel_err(scores[0, t, :visible], ref.qsa_block_scores(q[0, t], want_keys[:visible])) < 1.5e-2
