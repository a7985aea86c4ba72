"""The CPU verify's row-exact arithmetic (atlas.backends.cpu.rows, .weights): a product over joined weights gives
each part's columns the bits of that part's own product, one row or several; a verify pass of K rows gives each
row the bits of feeding the tokens one at a time, on atlas-tiny and on atlas-mini (whose shapes the benchmark
runs); the causal conv's fused multiply-adds are F.conv1d's bits, column by column."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atlas.backends.cpu import moe
from atlas.backends.cpu.decoder import forward_chunk, forward_rows
from atlas.backends.cpu.gdn import causal_conv
from atlas.backends.cpu.rows import EXACT
from atlas.backends.cpu.state import KvPool, SequenceState
from atlas.backends.cpu.weights import PRE_FC_NORMS, join_weights, joined
from atlas.backends.ops import rms_norm
from atlas.model import load_model
from atlas.model.loader import MINI_MODEL_DIR

MODELS = ["atlas-tiny", pytest.param("atlas-mini", marks=pytest.mark.skipif(
    not (MINI_MODEL_DIR / "config.json").is_file(), reason=f"no checkpoint in {MINI_MODEL_DIR}"))]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", MODELS)
def test_a_joined_product_gives_every_part_its_own_products_bits(name: str) -> None:
    model = load_model(name)
    raw, prepared = model.weights, join_weights(model.spec, model.weights)
    joins = [k for k in prepared if k not in raw and prepared[k].dim() == 2]
    assert len(joins) >= 3 * model.spec.num_layers  # mixer, two hyper-connections (or MoE/dense), per layer
    gen = torch.Generator().manual_seed(0)
    # the MTP drafter's two input norms as one grouped norm
    norms, _ = joined(prepared, "mtp.", PRE_FC_NORMS)
    hidden = model.spec.hidden_size
    for n in (1, 3):
        both = torch.randn(n, 2 * hidden, generator=gen) * 3
        apart = torch.cat([rms_norm(both[:, :hidden], raw["mtp.pre_fc_norm_embedding.weight"], 1e-6),
                           rms_norm(both[:, hidden:], raw["mtp.pre_fc_norm_hidden.weight"], 1e-6)], dim=-1)
        assert torch.equal(rms_norm(both, norms, 1e-6, group=hidden), apart)
    for key in joins:
        pre, inner = key.split("joined(")
        parts = tuple(inner.rstrip(")").split(","))
        weight, sizes = joined(prepared, pre, parts)
        assert len(sizes) >= 2 and weight.shape[0] == sum(sizes)
        for n in (1, 3, 5):
            x = torch.randn(n, weight.shape[1], generator=gen) * 3
            together = EXACT.mm(x, weight).split(sizes, dim=-1)
            alone = [EXACT.mm(x, raw[pre + p]) for p in parts if pre + p in raw]
            for got, want in zip(together, alone, strict=True):
                assert torch.equal(got, want), (key, n)
            if n > 1:  # and each row is the one-row product's
                assert torch.equal(EXACT.mm(x[-1:], weight), EXACT.mm(x, weight)[-1:]), (key, n)


@pytest.mark.parametrize("name", MODELS)
def test_a_verify_pass_gives_every_row_the_bits_of_a_token_by_token_feed(name: str) -> None:
    model = load_model(name)
    spec, w, dtype = model.spec, join_weights(model.spec, model.weights), model.dtype
    kv = KvPool(spec, 8, 16, dtype)
    table = tuple(range(8))
    ids = (torch.arange(40) * 7 + 3) % (spec.vocab_size - 4) + 4
    state, hidden = SequenceState.empty(spec, dtype), []
    for i in range(len(ids)):
        h, state = forward_chunk(spec, w, kv, state, ids[i : i + 1], i, table)
        hidden.append(h)
    start = 36  # the last 4 positions again, as one verify pass from the state at 36
    before = SequenceState.empty(spec, dtype)
    for i in range(start):
        _, before = forward_chunk(spec, w, kv, before, ids[i : i + 1], i, table)
    rows, states = forward_rows(spec, w, kv, before, ids[start:], start, table)
    assert torch.equal(rows, torch.cat(hidden[start:]))
    for layer in state.gdn_recurrent:
        assert torch.equal(states[-1].gdn_recurrent[layer], state.gdn_recurrent[layer])
        assert torch.equal(states[-1].gdn_conv[layer], state.gdn_conv[layer])
    for layer in state.ple_conv:
        assert torch.equal(states[-1].ple_conv[layer], state.ple_conv[layer])


@pytest.mark.parametrize(("channels", "dilation", "n"), [(7, 1, 1), (128, 1, 3), (512, 1, 5), (512, 3, 1), (96, 3, 4)])
def test_the_causal_conv_is_conv1ds_bits_column_by_column(channels: int, dilation: int, n: int) -> None:
    gen = torch.Generator().manual_seed(channels + n)
    taps, state = 4, 3 * dilation + 1
    prev = torch.randn(channels, state, generator=gen) * 3
    new = torch.randn(channels, n, generator=gen) * torch.randn(channels, n, generator=gen).exp()
    weight = torch.randn(channels, 1, taps, generator=gen)
    out, after, cols = causal_conv(prev, new, weight, dilation)
    assert torch.equal(after, cols[:, -state:]) and cols.shape == (channels, state + n)
    reach = (taps - 1) * dilation
    for t in range(n):  # each column as a one-column F.conv1d over its own window
        window = cols[None, :, state + t - reach : state + t + 1]
        assert torch.equal(out[:, t], F.conv1d(window, weight, groups=channels, dilation=dilation)[0, :, 0])


@pytest.mark.parametrize("width", [1, 2, 4, 16, 17, 64, 100, 128])
def test_each_gives_every_row_a_lone_rows_bits_contiguous_or_a_part_of_a_joined_product(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    for n in (2, 3, 5, 8):
        joined_rows = torch.randn(n, width + 3, generator=gen) * 4
        for x in (joined_rows[:, :width].contiguous(), joined_rows[:, :width], joined_rows[:, 3:]):
            for fn in (torch.sigmoid, F.silu, F.softplus):
                want = torch.cat([fn(x[i : i + 1].clone()) for i in range(n)])
                assert torch.equal(EXACT.each(fn, x), want), (fn, n, x.stride())
            # unwrapped in the layers: softmax over the last dim and exp are row-exact as they are
            assert torch.equal(torch.softmax(x, dim=-1), torch.cat([torch.softmax(r.clone(), -1) for r in x.split(1)]))
            assert torch.equal((-x.abs()).exp(), torch.cat([(-r.clone().abs()).exp() for r in x.split(1)]))


@pytest.mark.parametrize("name", MODELS)
def test_every_expert_on_every_row_is_the_per_expert_loops_bits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(name)
    spec, w = model.spec, join_weights(model.spec, model.weights)
    assert spec.moe is not None and spec.moe.num_experts <= moe.DENSE_EXPERTS
    gen = torch.Generator().manual_seed(1)
    layer = next(i for i, on in enumerate(spec.moe_layers) if on)
    for n in (1, 3, 5):
        x = torch.randn(n, spec.hidden_size, generator=gen)
        every = moe.moe_block(spec.moe, w, f"layers.{layer}.mlp.", x, EXACT)
        with monkeypatch.context() as patch:
            patch.setattr(moe, "DENSE_EXPERTS", 0)  # the loop over the experts the rows chose
            loop = moe.moe_block(spec.moe, w, f"layers.{layer}.mlp.", x, EXACT)
        assert torch.equal(every, loop), n
        assert torch.equal(moe.moe_block(spec.moe, w, f"layers.{layer}.mlp.", x[-1:], EXACT), every[-1:])
