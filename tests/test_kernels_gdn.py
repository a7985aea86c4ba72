"""GDN Triton kernels (recurrent decode/verify update, chunked prefill) against the plain-torch reference.

Without a GPU the kernels run under TRITON_INTERPRET=1 at small sizes; with one, the same tests run compiled,
and the `cuda` ones add the benchmark model's head shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' import

from atlas_kernels import reference as ref
from atlas_kernels.gdn_chunk_split import gdn_chunk_prefill_gated, gdn_chunk_prefill_split
from atlas_kernels.gdn_recurrent import gdn_recurrent, gdn_recurrent_gated

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def split_prefill(*args: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    return gdn_chunk_prefill_split(*args, max_seqlen)


def split_squaring_prefill(*args: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """The split kernels with the WY inverse by repeated squaring of the whole chunk (the default: 16 x 16 blocks)"""
    return gdn_chunk_prefill_split(*args, max_seqlen, inverse="squaring")


def split_bf16_prefill(*args: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """The split kernels with bf16 work (bf16 inputs; fp32 inputs keep the fp32 work, the parity mode)"""
    work = "bf16" if args[2].dtype == torch.bfloat16 else "fp32"
    return gdn_chunk_prefill_split(*args, max_seqlen, work=work)


def split_registers_prefill(*args: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """The split kernels with the registers prepare (16-row blocks, no global scratch) and fp32 work"""
    return gdn_chunk_prefill_split(*args, max_seqlen, prepare="registers")


def split_bf16_registers_prefill(*args: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """The registers prepare with bf16 work (its products on bf16 operands, p stored in bf16) for bf16 inputs"""
    work = "bf16" if args[2].dtype == torch.bfloat16 else "fp32"
    return gdn_chunk_prefill_split(*args, max_seqlen, work=work, prepare="registers")


PREFILLS = pytest.mark.parametrize(
    "prefill",
    [split_prefill, split_squaring_prefill, split_bf16_prefill, split_registers_prefill,
     split_bf16_registers_prefill],
    ids=["split", "split-squaring", "split-bf16", "split-registers", "split-bf16-registers"])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any(), "NaN in the kernel's output"
    return float((got.double() - want.double()).norm() / want.double().norm())


def random_gdn(gen: torch.Generator, lead: tuple[int, ...], k_heads: int, v_heads: int, dk: int, dv: int,
               dtype: torch.dtype):
    """q, k, v, g, beta as the GDN layer makes them: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    q, k = randn(*lead, k_heads, dk), randn(*lead, k_heads, dk)
    v = randn(*lead, v_heads, dv)
    a_decay = torch.empty(v_heads).uniform_(0.01, 16, generator=gen)
    a = torch.randn(*lead, v_heads, generator=gen)
    g = (-a_decay * torch.nn.functional.softplus(a - 4.0)).to(DEVICE)  # fp32, as the layer computes it
    beta = torch.sigmoid(torch.randn(*lead, v_heads, generator=gen)).to(DEVICE, dtype)
    return q, k, v, g, beta


def random_pool(gen: torch.Generator, slots: int, v_heads: int, dk: int, dv: int) -> torch.Tensor:
    return (0.3 * torch.randn(slots, v_heads, dk, dv, generator=gen)).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_recurrent_matches_reference(dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator().manual_seed(10 + tokens)
    seqs, k_heads, v_heads, dk, dv = 3, 2, 4, 32, 48  # dv not a power of two: masked tiles
    q, k, v, g, beta = random_gdn(gen, (seqs, tokens), k_heads, v_heads, dk, dv, dtype)
    pool = random_pool(gen, 5, v_heads, dk, dv)
    before = pool.clone()
    slots = torch.tensor([4, 0, 2], device=DEVICE)

    out, states = gdn_recurrent(q, k, v, g, beta, pool, slots, store_states=True)

    assert out.dtype == dtype and states is not None
    for n in range(seqs):
        want_out, want_states = ref.gdn_recurrent(q[n], k[n], v[n], g[n], beta[n], before[slots[n]])
        assert rel_err(out[n], want_out) < TOLERANCE[dtype]
        assert rel_err(states[n], want_states) < TOLERANCE[torch.float32]  # fp32 state from the same inputs
        assert rel_err(pool[slots[n]], want_states[-1]) < TOLERANCE[torch.float32]
    for untouched in (1, 3):
        assert torch.equal(pool[untouched], before[untouched])


def test_verify_without_commit_leaves_state_and_states_allow_partial_accept() -> None:
    gen = torch.Generator().manual_seed(20)
    q, k, v, g, beta = random_gdn(gen, (2, 4), 1, 2, 16, 16, torch.float32)
    pool = random_pool(gen, 2, 2, 16, 16)
    before = pool.clone()
    slots = torch.tensor([1, 0], device=DEVICE)

    _, states = gdn_recurrent(q, k, v, g, beta, pool, slots, store_states=True, commit=False)

    assert torch.equal(pool, before)
    assert states is not None
    accepted = 2  # commit the state after token 2 of sequence 0, then decode token 3 from it
    pool[slots[0]] = states[0, accepted - 1]
    out3, _ = gdn_recurrent(q[:1, accepted:accepted + 1], k[:1, accepted:accepted + 1],
                            v[:1, accepted:accepted + 1], g[:1, accepted:accepted + 1],
                            beta[:1, accepted:accepted + 1], pool, slots[:1])
    want_out, want_states = ref.gdn_recurrent(q[0, :3], k[0, :3], v[0, :3], g[0, :3], beta[0, :3], before[1])
    assert rel_err(out3[0, 0], want_out[2]) < TOLERANCE[torch.float32]
    assert rel_err(pool[slots[0]], want_states[2]) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("tokens", [1, 3])
def test_gated_recurrent_on_conv_output_slices_matches_reference(tokens: int) -> None:
    """q, k, v as strided slices of one conv output [N, T, 2 Hk dk + Hv dv] (no copies), gates from raw a, b
    that are strided slices of one projection output too (read at their token stride, no copies)."""
    gen = torch.Generator().manual_seed(60 + tokens)
    seqs, k_heads, v_heads, dk, dv = 2, 2, 4, 16, 32
    key_dim = k_heads * dk
    mixed = torch.randn(seqs, tokens, 2 * key_dim + v_heads * dv, generator=gen).to(DEVICE, torch.bfloat16)
    q = mixed[..., :key_dim].view(seqs, tokens, k_heads, dk)
    k = mixed[..., key_dim : 2 * key_dim].view(seqs, tokens, k_heads, dk)
    v = mixed[..., 2 * key_dim :].view(seqs, tokens, v_heads, dv)
    proj = torch.randn(seqs, tokens, 2 * v_heads + 5, generator=gen).to(DEVICE, torch.bfloat16)
    a, b = proj[..., 3 : 3 + v_heads], proj[..., 3 + v_heads : 3 + 2 * v_heads]
    assert not a.is_contiguous() and not b.is_contiguous()
    a_log = torch.empty(v_heads).uniform_(0.01, 16, generator=gen).log().to(DEVICE)
    dt_bias = torch.randn(v_heads, generator=gen).to(DEVICE)
    pool = random_pool(gen, 3, v_heads, dk, dv)
    before = pool.clone()
    slots = torch.tensor([2, 0], device=DEVICE)

    stamps = torch.full((3,), 5, dtype=torch.int32, device=DEVICE)
    ends = torch.tensor([40, 9], dtype=torch.int32, device=DEVICE)
    out, _ = gdn_recurrent_gated(q, k, v, a, b, a_log, dt_bias, pool, slots, stamp=(stamps, ends))
    assert stamps.tolist() == [9, 5, 40]  # slot 2 is sequence 0's, slot 0 sequence 1's; slot 1 untouched
    with pytest.raises(ValueError, match="stamp= needs commit=True"):
        gdn_recurrent_gated(q, k, v, a, b, a_log, dt_bias, pool.clone(), slots, stamp=(stamps, ends), commit=False)

    g = -a_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    beta = torch.sigmoid(b.float())
    for n in range(seqs):
        want_out, want_states = ref.gdn_recurrent(q[n], k[n], v[n], g[n], beta[n], before[slots[n]])
        assert rel_err(out[n], want_out) < TOLERANCE[torch.bfloat16]
        assert rel_err(pool[slots[n]], want_states[-1]) < 1e-4


@PREFILLS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_matches_recurrent_reference(dtype: torch.dtype, prefill) -> None:
    gen = torch.Generator().manual_seed(30)
    lengths = [150, 7, 64]  # a partial last chunk, a prompt shorter than a chunk, exactly one chunk
    k_heads, v_heads, dk, dv = 2, 4, 32, 32
    q, k, v, g, beta = random_gdn(gen, (sum(lengths),), k_heads, v_heads, dk, dv, dtype)
    cu_seqlens = torch.tensor([0, 150, 157, 221], dtype=torch.int32, device=DEVICE)
    pool = random_pool(gen, 4, v_heads, dk, dv)
    before = pool.clone()
    slots = torch.tensor([3, 1, 0], device=DEVICE)

    out = prefill(q, k, v, g, beta, cu_seqlens, pool, slots, max_seqlen=150)

    # fp32: the chunked form reorders the sums; bf16: inputs rounded, dots in tf32
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2}[dtype]
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)):
        span = slice(start, end)
        want_out, want_states = ref.gdn_recurrent(q[span], k[span], v[span], g[span], beta[span],
                                                  before[slots[n]])
        assert rel_err(out[span], want_out) < tolerance
        assert rel_err(pool[slots[n]], want_states[-1]) < tolerance
    assert torch.equal(pool[2], before[2])


@pytest.mark.parametrize("prepare", ["scratch", "registers"])
def test_bf16_work_keeps_the_reference_within_bf16_error_and_refuses_fp32_inputs(prepare: str) -> None:
    """work='bf16' (w / u / p and the scan's product operands in bf16, the state fp32): against the recurrent
    reference on a 150-token prompt: output 3.3e-3 against the fp32 work's 1.7e-3 (the output's own bf16 rounding),
    the state 2.8e-3 against 3e-7; fp32 inputs (the parity mode) are refused. The registers prepare (its products
    on bf16 operands too, X rounded to bf16 for w / u): output 4.1e-3, the state 3.5e-3 (CPU interpreter; at
    dk = dv = 128, 256 tokens: 4.1e-3 / 2.9e-3 against the scratch prepare's 3.1e-3 / 2.3e-3)."""
    gen = torch.Generator().manual_seed(31)
    lengths = [150, 7]
    q, k, v, g, beta = random_gdn(gen, (sum(lengths),), 2, 4, 32, 32, torch.bfloat16)
    cu_seqlens = torch.tensor([0, 150, 157], dtype=torch.int32, device=DEVICE)
    pool = random_pool(gen, 2, 4, 32, 32)
    before = pool.clone()
    slots = torch.tensor([1, 0], device=DEVICE)
    fp32_pool = before.clone()
    fp32_out = gdn_chunk_prefill_split(q, k, v, g, beta, cu_seqlens, fp32_pool, slots, 150, prepare=prepare)

    out = gdn_chunk_prefill_split(q, k, v, g, beta, cu_seqlens, pool, slots, 150, work="bf16", prepare=prepare)

    for n, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)):
        span = slice(start, end)
        want_out, want_states = ref.gdn_recurrent(q[span], k[span], v[span], g[span], beta[span], before[slots[n]])
        # measured 3.3e-3, registers 4.1e-3 (fp32 work 1.7e-3: the output's rounding)
        assert rel_err(out[span], want_out) < 1e-2
        assert rel_err(pool[slots[n]], want_states[-1]) < 1e-2  # measured 2.8e-3, registers 3.5e-3 (fp32 work 3e-7)
    # it is a different rounding, not the fp32 work's result under another name
    assert not torch.equal(out, fp32_out)
    with pytest.raises(ValueError, match="work='bf16' is for bf16 inputs"):
        gdn_chunk_prefill_split(q.float(), k.float(), v.float(), g, beta.float(), cu_seqlens, pool, slots, 150,
                                work="bf16")
    with pytest.raises(ValueError, match="work='fp16'"):
        gdn_chunk_prefill_split(q, k, v, g, beta, cu_seqlens, pool, slots, 150, work="fp16")


def test_prepare_choices_are_checked_and_a_register_cap_computes_the_same() -> None:
    gen = torch.Generator().manual_seed(32)
    q, k, v, g, beta = random_gdn(gen, (9,), 1, 2, 16, 16, torch.bfloat16)
    cu_seqlens = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    pool = random_pool(gen, 1, 2, 16, 16)
    slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="prepare='shared'"):
        gdn_chunk_prefill_split(q, k, v, g, beta, cu_seqlens, pool, slots, 9, prepare="shared")
    with pytest.raises(ValueError, match="prepare='registers' solves by 16 x 16 blocks"):
        gdn_chunk_prefill_split(q, k, v, g, beta, cu_seqlens, pool, slots, 9, prepare="registers", inverse="squaring")
    # a cap on the prepare's registers (more programs an SM, some spills) computes the same
    capped_pool = pool.clone()
    out = gdn_chunk_prefill_split(q, k, v, g, beta, cu_seqlens, pool, slots, 9, work="bf16", prepare="registers")
    capped = gdn_chunk_prefill_split(q, k, v, g, beta, cu_seqlens, capped_pool, slots, 9, work="bf16",
                                     prepare="registers", prepare_maxnreg=128)
    assert rel_err(capped, out) < 1e-6 and rel_err(capped_pool, pool) < 1e-6


@pytest.mark.parametrize(("prepare", "work"), [("scratch", "fp32"), ("registers", "fp32"), ("registers", "bf16")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_chunked_prefill_on_conv_output_slices_matches_reference(dtype: torch.dtype, prepare: str,
                                                                       work: str) -> None:
    """gdn_chunk_prefill_gated, as a GDN layer's prefill calls it: N sequences of T tokens, q / k / v strided
    slices of one conv output, the raw gates a / b strided slices of one projection (read in place, the gates
    computed in the kernel), the state's stamp written by the scan; against the recurrent reference, and equal
    to gdn_chunk_prefill_split given the torch-computed gates on contiguous copies. Both prepare kernels (bf16 work
    only for bf16 inputs)."""
    if work == "bf16" and dtype == torch.float32:
        pytest.skip("bf16 work is for bf16 inputs")
    gen = torch.Generator().manual_seed(70)
    seqs, tokens, k_heads, v_heads, dk, dv = 2, 75, 2, 4, 16, 32  # a partial second chunk
    key_dim = k_heads * dk
    mixed = torch.randn(seqs, tokens, 2 * key_dim + v_heads * dv, generator=gen).to(DEVICE, dtype)
    q = mixed[..., :key_dim].view(seqs, tokens, k_heads, dk)
    k = mixed[..., key_dim : 2 * key_dim].view(seqs, tokens, k_heads, dk)
    v = mixed[..., 2 * key_dim :].view(seqs, tokens, v_heads, dv)
    proj = torch.randn(seqs, tokens, 2 * v_heads + 5, generator=gen).to(DEVICE, dtype)
    a, b = proj[..., 3 : 3 + v_heads], proj[..., 3 + v_heads : 3 + 2 * v_heads]
    a_log = torch.empty(v_heads).uniform_(0.01, 16, generator=gen).log().to(DEVICE)
    dt_bias = (torch.randn(v_heads, generator=gen) - 4.0).to(DEVICE)
    pool = random_pool(gen, 3, v_heads, dk, dv)
    before = pool.clone()
    slots = torch.tensor([2, 0], device=DEVICE)
    stamps = torch.full((3,), 5, dtype=torch.int32, device=DEVICE)
    ends = torch.tensor([40, 9], dtype=torch.int32, device=DEVICE)

    out = gdn_chunk_prefill_gated(q, k, v, a, b, a_log, dt_bias, pool, slots, stamp=(stamps, ends), prepare=prepare,
                                  work=work)

    assert out.shape == (seqs, tokens, v_heads, dv) and out.dtype == dtype
    assert stamps.tolist() == [9, 5, 40]  # slot 2 is sequence 0's, slot 0 sequence 1's; slot 1 untouched
    assert torch.equal(pool[1], before[1])
    g = -a_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    beta = torch.sigmoid(b.float())
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2}[dtype]
    for n in range(seqs):
        want_out, want_states = ref.gdn_recurrent(q[n], k[n], v[n], g[n], beta[n], before[slots[n]])
        assert rel_err(out[n], want_out) < tolerance
        assert rel_err(pool[slots[n]], want_states[-1]) < tolerance
    split_pool = before.clone()
    cu = torch.tensor([0, tokens, 2 * tokens], dtype=torch.int32, device=DEVICE)
    flat = [x.reshape(seqs * tokens, *x.shape[2:]) for x in (q, k, v, g, beta)]
    split = gdn_chunk_prefill_split(*flat, cu, split_pool, slots, tokens, block_v=32, scan_warps=4, prepare=prepare,
                                    work=work)
    # the same kernels, the gates in the kernel against torch's (exp / log1p a rounding apart: bf16 outputs
    # then flip an ulp here and there)
    same = {torch.float32: 1e-5, torch.bfloat16: 2e-3}[dtype]  # (the reference's tolerance: 1e-4 / 1.5e-2)
    assert rel_err(out.reshape(split.shape), split) < same
    # the states likewise: with bf16 work the state's products take bf16 operands, so the gates' rounding apart flips
    # some of their roundings (1.2e-4 on this 2-core Xeon under the interpreter, below 1e-4 on an earlier box)
    assert rel_err(pool, split_pool) < (5e-4 if work == "bf16" else 1e-4)


@PREFILLS
def test_prefill_then_decode_continues_the_same_recurrence(prefill) -> None:
    gen = torch.Generator().manual_seed(40)
    q, k, v, g, beta = random_gdn(gen, (70,), 1, 2, 16, 16, torch.float32)
    pool = torch.zeros(1, 2, 16, 16, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
    cu_seqlens = torch.tensor([0, 69], dtype=torch.int32, device=DEVICE)

    prefill(q[:69], k[:69], v[:69], g[:69], beta[:69], cu_seqlens, pool, slots, max_seqlen=69)
    last, _ = gdn_recurrent(q[None, 69:], k[None, 69:], v[None, 69:], g[None, 69:], beta[None, 69:], pool, slots)

    want_out, _ = ref.gdn_recurrent(q, k, v, g, beta, torch.zeros(2, 16, 16, device=DEVICE))
    assert rel_err(last[0, 0], want_out[69]) < 1e-4


@cuda
@pytest.mark.cuda
@PREFILLS
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_benchmark_shapes_on_gpu(dtype: torch.dtype, prefill) -> None:
    """Hk 16, Hv 32, dk = dv = 128 (qwen4exp-2p7b): verify of 4 tokens for 8 sequences, a 2048-token prefill.
    bf16 only: the fp32 (ieee) chunk kernels at dk = 128 spill tens of KB and took ~100 s to compile on the
    H200; fp32 is covered compiled at the small sizes above."""
    gen = torch.Generator().manual_seed(50)
    q, k, v, g, beta = random_gdn(gen, (8, 4), 16, 32, 128, 128, dtype)
    pool = random_pool(gen, 8, 32, 128, 128)
    before = pool.clone()
    slots = torch.arange(8, device=DEVICE).flip(0)
    out, _ = gdn_recurrent(q, k, v, g, beta, pool, slots)
    for n in (0, 7):
        want_out, want_states = ref.gdn_recurrent(q[n], k[n], v[n], g[n], beta[n], before[slots[n]])
        assert rel_err(out[n], want_out) < TOLERANCE[dtype]
        assert rel_err(pool[slots[n]], want_states[-1]) < TOLERANCE[torch.float32]

    q, k, v, g, beta = random_gdn(gen, (2048,), 16, 32, 128, 128, dtype)
    pool = random_pool(gen, 1, 32, 128, 128)
    before = pool.clone()
    out = prefill(q, k, v, g, beta, torch.tensor([0, 2048], dtype=torch.int32, device=DEVICE), pool,
                  torch.zeros(1, dtype=torch.long, device=DEVICE), max_seqlen=2048)
    want_out, want_states = ref.gdn_recurrent(q, k, v, g, beta, before[0])
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2}[dtype]
    assert rel_err(out, want_out) < tolerance
    assert rel_err(pool[0], want_states[-1]) < tolerance
