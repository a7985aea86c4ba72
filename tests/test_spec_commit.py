"""The exact partial-accept commit on the CPU backend: after a K-wide verify that accepts n drafts (committed
by the backend in the same execute), the sequence's state is bitwise the state of one that decoded those n + 1
tokens one at a time (GDN conv and recurrent state, PLE context and short conv, QSA raw keys, KV rows, MTP
drafter rows, next logits), and a refused commit changes nothing."""

from __future__ import annotations

import pytest
import torch

from atlas.backends.cpu import CpuBackend
from atlas.backends.cpu.mtp import mtp_forward
from atlas.errors import VerifyRefused
from atlas.model import load_model
from atlas.plan import SeqWork, StepPlan

BLOCKS = tuple(range(8))  # 8 blocks of 16: 128 positions
PROMPT = list(b"speculative commit: the state after n of K!")  # 43 tokens: past the QSA inert bound (19)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("atlas-tiny")


def backend(tiny, width: int = 5) -> CpuBackend:
    return CpuBackend(tiny, num_kv_blocks=len(BLOCKS), verify_width=width, mtp_drafter=True)


def feed(b: CpuBackend, tokens: list[int], start: int, step: int = 0) -> int:
    """Feed tokens as one chunk and return the greedy token after them."""
    (o,) = b.execute(StepPlan(step, (SeqWork(0, tuple(tokens), start, BLOCKS, True),))).outcomes
    assert o.token is not None
    return o.token


def greedy_continuation(tiny, n: int) -> list[int]:
    b = backend(tiny)
    out = [feed(b, PROMPT, 0)]
    for i in range(n - 1):
        out.append(feed(b, [out[-1]], len(PROMPT) + i))
    return out


def assert_same_state(a: CpuBackend, b: CpuBackend) -> None:
    sa, sb = a.store.seqs[0], b.store.seqs[0]
    assert (sa.kv_tokens, sa.ssm_position, sa.ple_position) == (sb.kv_tokens, sb.ssm_position, sb.ple_position)
    for layer in sa.gdn_conv:
        assert torch.equal(sa.gdn_conv[layer], sb.gdn_conv[layer])
        assert torch.equal(sa.gdn_recurrent[layer], sb.gdn_recurrent[layer])
    assert sa.qsa_keys.keys() == sb.qsa_keys.keys() and sa.qsa_keys
    for layer in sa.qsa_keys:
        assert torch.equal(sa.qsa_keys[layer], sb.qsa_keys[layer])
    assert torch.equal(sa.ple_context, sb.ple_context)
    for layer in sa.ple_conv:
        assert torch.equal(sa.ple_conv[layer], sb.ple_conv[layer])
    slots = a.kv.slots(BLOCKS, 0, sa.kv_tokens)
    for layer in a.kv.keys:
        assert torch.equal(a.kv.read(layer, slots)[0], b.kv.read(layer, slots)[0])
        assert torch.equal(a.kv.read(layer, slots)[1], b.kv.read(layer, slots)[1])
    da, db = a.store.drafts[0], b.store.drafts[0]
    assert da.rows == db.rows == sa.kv_tokens - 1
    rows = torch.arange(da.rows)
    for layer in da.kv.keys:
        assert torch.equal(da.kv.read(layer, rows)[0], db.kv.read(layer, rows)[0])
    assert a.cursors(0) == b.cursors(0)
    assert a.store.state_digest(0) == b.store.state_digest(0)


@pytest.mark.parametrize(("k", "accepted"), [(2, 0), (2, 1), (3, 1), (5, 0), (5, 2), (5, 4)])
def test_commit_of_n_accepted_equals_decoding_them_one_at_a_time(tiny, k: int, accepted: int) -> None:
    ref = greedy_continuation(tiny, k + 1)
    # drafts: the first `accepted` are what the target decodes, the next one is wrong
    drafts = tuple(ref[1 : 1 + accepted]) + tuple((t + 1) % 256 for t in ref[1 + accepted : k])
    drafts = drafts[: k - 1]

    spec = backend(tiny)
    assert feed(spec, PROMPT, 0) == ref[0]
    work = SeqWork(0, (ref[0],), len(PROMPT), BLOCKS, True, drafts=drafts)
    (o,) = spec.execute(StepPlan(1, (work,))).outcomes
    assert len(o.verdicts) == k
    assert [v.accept for v in o.verdicts[:accepted]] == [True] * accepted
    n = accepted
    if accepted < k - 1:
        assert not o.verdicts[accepted].accept
    assert [v.token for v in o.verdicts[: n + 1]] == ref[1 : n + 2]  # drafts kept, then the correction
    assert o.accepted == n and o.token == ref[n + 1]  # committed in the same execute
    assert spec.cursors(0).kv_tokens == len(PROMPT) + n + 1

    plain = backend(tiny)
    feed(plain, PROMPT, 0)
    for i in range(n + 1):
        feed(plain, [ref[i]], len(PROMPT) + i)
    assert_same_state(plain, spec)
    # and the next step's logits, through the same path
    nxt = ref[n + 1]
    la = plain.forward([SeqWork(0, (nxt,), len(PROMPT) + n + 1, BLOCKS, True)])[0]
    lb = spec.forward([SeqWork(0, (nxt,), len(PROMPT) + n + 1, BLOCKS, True)])[0]
    assert torch.equal(la, lb)


def test_a_refused_commit_changes_nothing(tiny) -> None:
    b = backend(tiny, width=3)
    first = feed(b, PROMPT, 0)
    before = b.store.state_digest(0)
    cursors = b.cursors(0)
    rows = b.store.drafts[0].rows
    b.verify(SeqWork(0, (first,), len(PROMPT), BLOCKS, True, drafts=(1, 2)))  # rows fed, waiting for the commit
    for bad in (0, 4):  # nothing accepted at all, or more rows than the verify fed
        with pytest.raises(VerifyRefused):
            b.store.commit(0, bad)
    assert b.cursors(0) == cursors and b.store.drafts[0].rows == rows
    assert b.store.state_digest(0) == before
    b.store.commit(0, 1)  # still committable after the refusals
    assert b.cursors(0).kv_tokens == len(PROMPT) + 1
    with pytest.raises(VerifyRefused):  # a verify commits once
        b.store.commit(0, 1)


def test_a_verify_wider_than_the_intermediate_pool_is_refused_before_anything_runs(tiny) -> None:
    b = backend(tiny, width=2)
    first = feed(b, PROMPT, 0)
    with pytest.raises(ValueError, match="verify_width"):
        b.execute(StepPlan(1, (SeqWork(0, (first,), len(PROMPT), BLOCKS, True, drafts=(1, 2)),)))
    assert b.cursors(0).kv_tokens == len(PROMPT)


def test_incremental_drafter_rows_match_the_stateless_reference(tiny) -> None:
    """Pair key k = (embed(t_{k+1}), hidden_k) at RoPE k + 1: the drafter's draft for the token after the
    prompt's next one equals the stateless reference over all pair keys (chunked prefill included)."""
    b = backend(tiny)
    b.execute(StepPlan(0, (SeqWork(0, tuple(PROMPT[:20]), 0, BLOCKS, False),)))
    (o,) = b.execute(StepPlan(1, (SeqWork(0, tuple(PROMPT[20:]), 20, BLOCKS, True, propose=2),))).outcomes
    nxt, drafts = o.token, o.drafts
    assert nxt is not None and len(drafts) == 2  # proposed in the same execute, for the next step
    assert b.store.drafts[0].rows == len(PROMPT) - 1  # proposing keeps no row
    hidden = b.forward_hidden([SeqWork(0, tuple(PROMPT), 0, BLOCKS, True)])[0]  # the target's hidden per position
    logits, own = mtp_forward(tiny.spec, b.weights, hidden, torch.tensor([*PROMPT[1:], nxt]))
    assert drafts[0] == int(torch.argmax(logits[-1]))
    # draft 2 pairs draft 1 with the drafter's own hidden of the previous key
    logits2, _ = mtp_forward(tiny.spec, b.weights, torch.cat([hidden, own[-1:]]),
                             torch.tensor([*PROMPT[1:], nxt, drafts[0]]))
    assert drafts[1] == int(torch.argmax(logits2[-1]))
