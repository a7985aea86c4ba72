"""The CPU backend's state handling on atlas-tiny: batching, paging, cursors, snapshots, execute()."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atlas.backends.cpu import Chunk, CpuBackend
from atlas.model import load_model
from atlas.model.weights import mtp_shapes
from atlas.plan import SeqWork, StepPlan
from atlas.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return load_model("atlas-tiny")


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n,), generator=g)
    ids[n // 2] = 256  # EOS mid-prompt: the PLE context restarts
    return ids.tolist()


def test_tiny_builds_fast_with_every_feature(tiny):
    t0 = time.perf_counter()
    model = load_model("atlas-tiny")
    elapsed = time.perf_counter() - t0
    print(f"\natlas-tiny built in {elapsed * 1000:.0f} ms")
    assert elapsed < 5.0
    spec = model.spec
    assert spec.family == "qwen4_exp" and spec.qsa is not None and spec.ple is not None and spec.moe is not None
    assert spec.hc_count >= 2 and spec.gdn_layers and spec.attention_layers
    assert spec.qsa.inert_bound == 19  # sparse attention starts within ~40 tokens
    for name, shape in mtp_shapes(spec).items():
        assert tuple(model.weights[name].shape) == shape
    assert model.fingerprint == tiny.fingerprint  # fixed seed


def test_tiny_saved_to_a_dir_loads_to_the_same_model(tiny, tmp_path):
    from atlas.model.tiny import save

    loaded = load_model(save(tmp_path / "tiny"))
    assert loaded.fingerprint == tiny.fingerprint
    assert loaded.weights.keys() == tiny.weights.keys()
    assert all(torch.equal(loaded.weights[k], tiny.weights[k]) for k in tiny.weights)


def test_tiny_greedy_generation_is_not_degenerate(tiny):
    backend = CpuBackend(tiny, num_kv_blocks=8)
    ids = tiny.tokenizer.encode("Once upon a time")
    logits = backend.forward([Chunk(0, ids, 0, range(8))])[0]
    assert logits.abs().max() < 20  # O(1) logits
    out = []
    for _ in range(32):
        out.append(int(logits[-1].argmax()))
        logits = backend.forward([Chunk(0, [out[-1]], len(ids) + len(out) - 1, range(8))])[0]
    assert len(set(out)) >= 8 and out.count(256) < 4


def test_batched_sequences_match_each_alone_bitwise(tiny):
    a, b = _prompt(37, 1), _prompt(23, 2)
    alone_a = CpuBackend(tiny, num_kv_blocks=16, block_size=4)
    alone_b = CpuBackend(tiny, num_kv_blocks=16, block_size=4)
    batched = CpuBackend(tiny, num_kv_blocks=16, block_size=4)
    table_a, table_b = (9, 2, 14, 0, 7, 11, 3, 5, 1, 15), (4, 6, 8, 10, 12, 13)  # interleaved, out of order
    ref_a = alone_a.forward([Chunk(1, a[:30], 0, table_a)])[0]
    ref_b = alone_b.forward([Chunk(2, b[:11], 0, table_b)])[0]
    got_a, got_b = batched.forward([Chunk(2, b[:11], 0, table_b), Chunk(1, a[:30], 0, table_a)])[::-1]
    assert torch.equal(ref_a, got_a) and torch.equal(ref_b, got_b)
    # then mixed steps: a decodes one at a time while b prefills the rest in uneven chunks
    pos_a, pos_b = 30, 11
    for width_b in (5, 1, 6):
        ref_a = alone_a.forward([Chunk(1, a[pos_a : pos_a + 1], pos_a, table_a)])[0]
        ref_b = alone_b.forward([Chunk(2, b[pos_b : pos_b + width_b], pos_b, table_b)])[0]
        got_a, got_b = batched.forward(
            [Chunk(1, a[pos_a : pos_a + 1], pos_a, table_a), Chunk(2, b[pos_b : pos_b + width_b], pos_b, table_b)]
        )
        assert torch.equal(ref_a, got_a) and torch.equal(ref_b, got_b)
        pos_a, pos_b = pos_a + 1, pos_b + width_b
    assert batched.cursors(1).kv_tokens == pos_a and batched.cursors(2).kv_tokens == pos_b == 23


def test_cursors_move_together(tiny):
    backend = CpuBackend(tiny, num_kv_blocks=8, block_size=8)
    ids = _prompt(29, 3)
    backend.forward([Chunk(5, ids[:13], 0, range(8))])
    c = backend.cursors(5)
    assert (c.kv_tokens, c.qsa_ingested, c.ssm_position, c.ple_position) == (13, 13, 13, 13)
    backend.forward([Chunk(5, ids[13:], 13, range(8))])
    c = backend.cursors(5)
    assert (c.kv_tokens, c.qsa_ingested, c.ssm_position, c.ple_position) == (29, 29, 29, 29)


def test_snapshot_restore_rewinds_every_state(tiny):
    backend = CpuBackend(tiny, num_kv_blocks=8)
    ids = _prompt(40, 4)
    backend.forward([Chunk(0, ids[:25], 0, range(8))])
    snap = backend.store.copy_state(0)
    first = backend.forward([Chunk(0, ids[25:], 25, range(8))])[0]
    # continue differently, then rewind and replay the original continuation
    backend.store.rewind(0, snap)
    backend.forward([Chunk(0, [65, 66, 67], 25, range(8))])
    assert backend.cursors(0).kv_tokens == 28
    backend.store.rewind(0, snap)
    c = backend.cursors(0)
    assert (c.kv_tokens, c.qsa_ingested, c.ssm_position, c.ple_position) == (25, 25, 25, 25)
    again = backend.forward([Chunk(0, ids[25:], 25, range(8))])[0]
    assert torch.equal(first, again)
    later = backend.store.copy_state(0)
    backend.store.rewind(0, snap)
    with pytest.raises(ValueError, match="cannot restore to position 40"):
        backend.store.rewind(0, later)


def test_bad_chunks_are_refused_without_changing_state(tiny):
    backend = CpuBackend(tiny, num_kv_blocks=4, block_size=4)
    ids = _prompt(10, 5)
    backend.forward([Chunk(0, ids[:6], 0, range(4))])
    with pytest.raises(ValueError, match="starts at 7 but the backend holds 6"):
        backend.forward([Chunk(0, ids[6:], 7, range(4))])
    with pytest.raises(ValueError, match="block table has 1 blocks"):
        backend.forward([Chunk(0, ids[6:], 6, (0,))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        backend.forward([Chunk(0, [999], 6, range(4))])
    assert backend.cursors(0).kv_tokens == 6


def test_execute_samples_at_the_new_tokens_position_and_reports_cursors(tiny):
    backend = CpuBackend(tiny, num_kv_blocks=16, block_size=4)
    reference = CpuBackend(tiny, num_kv_blocks=16, block_size=4)
    a, b = _prompt(21, 6), _prompt(9, 7)
    greedy = SamplingParams(logprobs=True, top_logprobs=3)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    plan = StepPlan(
        step=0,
        work=(
            SeqWork(seq_id=1, tokens=tuple(a), start=0, block_table=tuple(range(6)), sample=True, sampling=greedy),
            SeqWork(seq_id=2, tokens=tuple(b), start=0, block_table=(8, 9, 10), sample=True, sampling=seeded),
        ),
    )
    result = backend.execute(plan)
    one, two = result.outcomes
    ref_logits = reference.forward([Chunk(1, a, 0, range(6))])[0][-1]
    assert one.token == int(ref_logits.argmax())
    assert one.logprob is not None and one.logprob == pytest.approx(float(torch.log_softmax(ref_logits.double(), -1).max()))
    assert len(one.top_logprobs) == 3 and one.top_logprobs[0][0] == one.token
    assert one.cursors.kv_tokens == 21 and two.cursors.kv_tokens == 9 and two.logprob is None
    # seeded sampling depends on (seed, position) only: the same sequence alone gives the same token
    alone = CpuBackend(tiny, num_kv_blocks=16, block_size=4).execute(StepPlan(step=0, work=(plan.work[1],)))
    assert alone.outcomes[0].token == two.token

    decode = StepPlan(
        step=1,
        work=(SeqWork(seq_id=1, tokens=(one.token,), start=21, block_table=tuple(range(6)), sample=True),),
        release=(2,),
    )
    result = backend.execute(decode)
    assert result.outcomes[0].cursors.kv_tokens == 22 and not backend.has_sequence(2)
    reset = backend.execute(StepPlan(step=2, work=(), reset=(1,)))
    assert reset.outcomes == () and backend.cursors(1).kv_tokens == 0


def test_fp64_on_request(tiny):
    ids = _prompt(30, 8)
    fp32 = CpuBackend(tiny, num_kv_blocks=4).forward([Chunk(0, ids, 0, range(4))])[0]
    backend64 = CpuBackend(tiny, num_kv_blocks=4, dtype=torch.float64)
    fp64 = backend64.forward([Chunk(0, ids, 0, range(4))])[0]
    assert fp64.dtype == torch.float64 and backend64.kv.keys[3].dtype == torch.float64
    assert (fp64 - fp32.double()).abs().max() < 1e-4


def test_hidden_states_are_the_lm_head_input(tiny):
    ids = _prompt(12, 9)
    a = CpuBackend(tiny, num_kv_blocks=2)
    b = CpuBackend(tiny, num_kv_blocks=2)
    hidden = a.forward_hidden([Chunk(0, ids, 0, range(2))])[0]
    assert hidden.shape == (12, tiny.spec.hidden_size)
    assert torch.equal(a.logits_from_hidden(hidden), b.forward([Chunk(0, ids, 0, range(2))])[0])


def test_reference_mtp_drafter_is_causal_over_pair_keys(tiny):
    backend = CpuBackend(tiny, num_kv_blocks=4)
    ids = _prompt(30, 10)
    hidden = backend.forward_hidden([Chunk(0, ids, 0, range(4))])[0]
    # pair key k = (embed(t_{k+1}), hidden_k): rows 0..28 draft t_2..t_30
    logits, drafter_hidden = backend.mtp_forward(hidden[:-1], ids[1:])
    assert logits.shape == (29, tiny.spec.vocab_size) and drafter_hidden.shape == (29, tiny.spec.hidden_size)
    assert logits.abs().max() < 50 and logits.std() > 0.1
    prefix, _ = backend.mtp_forward(hidden[:10], ids[1:11])
    torch.testing.assert_close(prefix, logits[:10], rtol=0, atol=1e-5)  # a row never sees later rows
    shifted, _ = backend.mtp_forward(hidden[:10], ids[1:11], first_key=5)
    # RoPE is relative: shifting every pair key's position alike leaves the drafts unchanged
    torch.testing.assert_close(shifted, prefix, rtol=0, atol=1e-4)


def test_a_bad_chunk_refuses_the_whole_batch_before_any_sequence_moves(tiny):
    backend = CpuBackend(tiny, num_kv_blocks=8, block_size=4)
    backend.forward([Chunk(1, [65, 66], 0, (0,)), Chunk(2, [67], 0, (1,))])
    with pytest.raises(ValueError, match="sequence 2: chunk starts at 3"):
        backend.forward([Chunk(1, [68], 2, (0,)), Chunk(2, [69], 3, (1,))])
    assert backend.cursors(1).kv_tokens == 2 and backend.cursors(2).kv_tokens == 1


@pytest.fixture(scope="module")
def single_chunk(tiny):
    """The 44-token prompt in one chunk: its logits and the state it leaves, computed once for every generated
    chunking below (each example rebuilt this same deterministic reference before)."""
    ids = _prompt(44, 11)
    reference = CpuBackend(tiny, num_kv_blocks=3)
    whole = reference.forward([Chunk(0, ids, 0, range(3))])[0]
    return ids, whole, reference.store.copy_state(0)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=1, max_value=43), max_size=8, unique=True))
def test_any_chunking_gives_the_single_chunk_logits_bitwise(tiny, single_chunk, cuts):
    """Chunk boundaries anywhere (inside QSA blocks, at EOS, width 1) never change a bit of the logits or
    of the state left behind: a token's result depends on the token and its prefix alone."""
    ids, whole, want = single_chunk
    backend = CpuBackend(tiny, num_kv_blocks=3)
    bounds = [0, *sorted(cuts), len(ids)]
    rows = [
        backend.forward([Chunk(0, ids[a:b], a, range(3))])[0] for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    assert torch.equal(torch.cat(rows), whole)
    got = backend.store.copy_state(0)
    for layer, state in want.gdn_recurrent.items():
        assert torch.equal(got.gdn_recurrent[layer], state) and torch.equal(got.gdn_conv[layer], want.gdn_conv[layer])
    for layer, state in want.ple_conv.items():
        assert torch.equal(got.ple_conv[layer], state)
