"""Paged decode/verify attention, dense and over a QSA selection, against the plain-torch reference."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from atlas_kernels import reference as ref
from atlas_kernels.paged_attention import paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any(), "NaN in the kernel's output"
    return float((got.double() - want.double()).norm() / want.double().norm())


def random_paged_kv(gen: torch.Generator, seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype):
    """K/V pools with each sequence's pages scattered in a shuffled order, and spare pages left unused."""
    pages_per_seq = max(-(-n // block_size) for n in seq_lens) + 1
    num_pages = len(seq_lens) * pages_per_seq + 3
    block_tables = torch.randperm(num_pages, generator=gen)[: len(seq_lens) * pages_per_seq]
    block_tables = block_tables.view(len(seq_lens), pages_per_seq).to(DEVICE, torch.int32)
    k_pool = torch.randn(num_pages, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_pool = torch.randn(num_pages, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return k_pool, v_pool, block_tables, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def random_selection(gen: torch.Generator, seq_lens: list[int], rows: int, ratio: int, budget: int):
    selected = torch.full((len(seq_lens), rows, budget + ratio - 1), -1, dtype=torch.int32)
    counts = torch.zeros(len(seq_lens), rows, dtype=torch.int32)
    for b, seq_len in enumerate(seq_lens):
        for t in range(rows):
            visible = seq_len - rows + t + 1
            tokens = ref.qsa_select(torch.rand(visible // ratio, generator=gen), visible, ratio, budget)
            selected[b, t, : tokens.numel()] = tokens
            counts[b, t] = tokens.numel()
    return selected.to(DEVICE), counts.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("qsa", [False, True])
def test_paged_attention_matches_reference(dtype: torch.dtype, rows: int, qsa: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 2 + qsa)
    seq_lens = [37, 5, 70]  # one past several partitions, one shorter than a page
    q_heads, kv_heads, head_dim, block_size = 4, 2, 32, 8
    k_pool, v_pool, block_tables, lens = random_paged_kv(gen, seq_lens, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(len(seq_lens), rows, q_heads, head_dim, generator=gen).to(DEVICE, dtype)
    selected = counts = None
    max_keys = max(seq_lens)
    if qsa:
        selected, counts = random_selection(gen, seq_lens, rows, ratio=4, budget=16)
        max_keys = selected.shape[-1]

    out = paged_attention(q, k_pool, v_pool, block_tables, lens, head_dim**-0.5, max_keys, selected, counts,
                          partition=32, block_n=16)

    want = ref.paged_attention(q, k_pool, v_pool, block_tables, lens, head_dim**-0.5, selected)
    assert out.dtype == dtype
    assert rel_err(out, want) < TOLERANCE[dtype]


def test_row_result_does_not_depend_on_the_batch() -> None:
    """Batch invariance: a sequence's output is bit-identical alone and among others."""
    gen = torch.Generator().manual_seed(7)
    k_pool, v_pool, block_tables, lens = random_paged_kv(gen, [70, 33, 9], 8, 2, 32, torch.bfloat16)
    q = torch.randn(3, 1, 4, 32, generator=gen).to(DEVICE, torch.bfloat16)
    together = paged_attention(q, k_pool, v_pool, block_tables, lens, 0.2, 70, partition=32, block_n=16)
    alone = paged_attention(q[:1], k_pool, v_pool, block_tables[:1], lens[:1], 0.2, 70, partition=32,
                            block_n=16)
    assert torch.equal(together[0], alone[0])


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("qsa", [False, True])
def test_benchmark_shapes_on_gpu(qsa: bool) -> None:
    """Hq 16, Hkv 2, D 128 (qwen4exp-2p7b), page 16, 8 sequences of up to 6000 tokens, verify of 4 rows."""
    gen = torch.Generator().manual_seed(8)
    seq_lens = [6000, 17, 2051, 2052, 4096, 300, 5000, 4]  # each >= the 4 verify rows (their own keys)
    k_pool, v_pool, block_tables, lens = random_paged_kv(gen, seq_lens, 16, 2, 128, torch.bfloat16)
    q = torch.randn(len(seq_lens), 4, 16, 128, generator=gen).to(DEVICE, torch.bfloat16)
    selected = counts = None
    max_keys = max(seq_lens)
    if qsa:
        selected, counts = random_selection(gen, seq_lens, 4, ratio=4, budget=2048)
        max_keys = selected.shape[-1]
    out = paged_attention(q, k_pool, v_pool, block_tables, lens, 128**-0.5, max_keys, selected, counts)
    want = ref.paged_attention(q, k_pool, v_pool, block_tables, lens, 128**-0.5, selected)
    assert rel_err(out, want) < TOLERANCE[torch.bfloat16]
