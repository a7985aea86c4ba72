"""The StateStore contract's conformance tests, written for any backend (atlas.backends.base.StateStore).

Each builds a backend through the `store_backend` fixture (the CPU reference in CI; the CUDA backend's modes on
a GPU, and its CPU path where it declares the features) and checks, with the backend's own state digest
(every byte of KV rows, QSA keys, GDN conv + recurrent, PLE and drafter rows): a restore yields the snapshot's
state; a verify that accepts n of K is n + 1 single decodes; a refused commit or restore changes nothing;
a prefix snapshot loads into another sequence as the same state; release and reset forget everything.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from atlas.backends.base import Backend, StateStore
from atlas.config import Capacities, EngineConfig, derive_capacities
from atlas.errors import RestoreRefused, VerifyRefused
from atlas.model import load_model
from atlas.plan import CarryOrder, PrefixRestore, PrefixStore, RingRestore, RingSnapshot, SeqWork, StepPlan

torch.set_num_threads(1)
TINY = load_model("atlas-tiny")
BLOCK = 4
CONFIG = EngineConfig(max_seq_len=96, max_batch_size=4, prefill_chunk_tokens=64, block_size=BLOCK, num_drafts=3,
                      ring_slots=2, enable_prefix_caching=True)
PROMPT = [(i * 37 + 11) % 256 for i in range(30)]  # past the QSA inert bound (19)


def _cpu(caps: Capacities) -> Backend:
    from atlas.backends.cpu import CpuBackend

    return CpuBackend.for_capacities(TINY, caps)


BACKENDS: dict[str, Callable[[Capacities], Backend]] = {"cpu": _cpu}


def _cuda(mode: str, device: str) -> Callable[[Capacities], Backend]:
    def build(caps: Capacities) -> Backend:
        from atlas.backends.cuda.runner import CudaBackend, parse_backend

        dtype, invariant = parse_backend(mode)
        return CudaBackend.for_capacities(TINY, caps, dtype=dtype, batch_invariant=invariant, name=mode,
                                          device=device, cuda_graphs=False)
    return build


def _declares_store(factory: Callable[[Capacities], Backend]) -> bool:
    try:
        b = factory(derive_capacities(CONFIG, TINY.spec, activation_bytes=4))
    except Exception:
        return False
    c = b.capabilities
    return c.verify and c.snapshot_ring and c.prefix_snapshots and c.mtp_drafting


if _declares_store(_cuda("cuda-fp32", "cpu")):
    BACKENDS["cuda-fp32 (cpu path)"] = _cuda("cuda-fp32", "cpu")
if torch.cuda.is_available():
    BACKENDS["cuda-fp32"] = _cuda("cuda-fp32", "cuda")


@pytest.fixture(params=sorted(BACKENDS), scope="module")
def store_backend(request: pytest.FixtureRequest) -> Callable[[], Backend]:
    factory = BACKENDS[request.param]
    caps = derive_capacities(CONFIG, TINY.spec, activation_bytes=4)
    return lambda: factory(caps)


def table(seq: int) -> tuple[int, ...]:
    per = -(-CONFIG.max_seq_len // BLOCK)
    return tuple(range(seq * per, (seq + 1) * per))


def feed(b: Backend, seq: int, tokens: list[int], start: int, *, step: int = 0, sample: bool = True,
         snapshot: RingSnapshot | None = None, tables: tuple[int, ...] | None = None) -> int | None:
    work = SeqWork(seq, tuple(tokens), start, tables or table(seq), sample)
    (o,) = b.execute(StepPlan(step, (work,), snapshots=(snapshot,) if snapshot else ())).outcomes
    return o.token


def greedy(b: Backend, seq: int, prompt: list[int], n: int) -> list[int]:
    out = [feed(b, seq, prompt, 0)]
    for i in range(n - 1):
        out.append(feed(b, seq, [out[-1]], len(prompt) + i, step=i + 1))
    return out  # type: ignore[return-value]


def test_the_backend_implements_the_protocols(store_backend) -> None:
    b = store_backend()
    assert isinstance(b, Backend)
    store = getattr(b, "store", b)
    assert isinstance(store, StateStore)


def test_a_restore_yields_the_snapshots_state(store_backend) -> None:
    b = store_backend()
    store = getattr(b, "store", b)
    feed(b, 0, PROMPT[:24], 0, sample=False, snapshot=RingSnapshot(0, 24, 0))
    at_24 = store.state_digest(0)
    feed(b, 0, PROMPT[24:], 24, step=1)
    assert store.state_digest(0) != at_24
    cursors = store.restore(RingRestore(0, 0, 24))
    assert cursors.as_tuple()[:4] == (24, 24, 24, 24)
    assert store.state_digest(0) == at_24
    fresh = store_backend()
    feed(fresh, 0, PROMPT[:24], 0, sample=False)
    assert getattr(fresh, "store", fresh).state_digest(0) == at_24  # and that is a fresh sequence fed 24 tokens
    with pytest.raises(RestoreRefused):  # the snapshots past the boundary went with the restore
        store.restore(RingRestore(0, 1, 30))


def test_a_refused_restore_changes_nothing(store_backend) -> None:
    b = store_backend()
    store = getattr(b, "store", b)
    feed(b, 0, PROMPT, 0, snapshot=RingSnapshot(0, 30, 1))
    before, cursors = store.state_digest(0), store.cursors(0)
    for order in (RingRestore(0, 0, 30), RingRestore(0, 1, 29), RingRestore(5, 1, 30)):
        with pytest.raises(RestoreRefused):
            store.restore(order)
        assert store.state_digest(0) == before and store.cursors(0) == cursors


@pytest.mark.parametrize("accepted", [0, 2, 3])
def test_a_verify_that_accepts_n_is_n_plus_1_decodes(store_backend, accepted: int) -> None:
    ref = greedy(store_backend(), 0, PROMPT, 5)
    drafts = tuple(ref[1:1 + accepted]) + tuple((t + 1) % 256 for t in ref[1 + accepted:4])
    b = store_backend()
    store = getattr(b, "store", b)
    assert feed(b, 0, PROMPT, 0) == ref[0]
    (o,) = b.execute(StepPlan(1, (SeqWork(0, (ref[0],), len(PROMPT), table(0), True, drafts=drafts[:3]),))).outcomes
    assert o.accepted == accepted and o.token == ref[accepted + 1]
    plain = store_backend()
    greedy(plain, 0, PROMPT, accepted + 2)  # the same tokens one at a time (the last one sampled, not fed)
    assert store.state_digest(0) == getattr(plain, "store", plain).state_digest(0)
    assert store.cursors(0) == plain.cursors(0)


def test_a_refused_commit_changes_nothing(store_backend) -> None:
    b = store_backend()
    store = getattr(b, "store", b)
    first = feed(b, 0, PROMPT, 0)
    before, cursors = store.state_digest(0), store.cursors(0)
    if not hasattr(b, "verify"):
        pytest.skip("the backend exposes no separate verify step")
    b.verify(SeqWork(0, (first,), len(PROMPT), table(0), True, drafts=(1, 2)))  # type: ignore[attr-defined]
    for rows in (0, 4):
        with pytest.raises(VerifyRefused):
            store.commit(0, rows)
    assert store.cursors(0) == cursors and store.state_digest(0) == before
    store.commit(0, 1)
    assert store.cursors(0).kv_tokens == len(PROMPT) + 1


def test_a_prefix_snapshot_loads_into_another_sequence_as_the_same_state(store_backend) -> None:
    b = store_backend()
    store = getattr(b, "store", b)
    feed(b, 0, PROMPT[:26], 0, sample=False)  # 26: six full blocks of 4, and two rows of the seventh
    store.store_prefix(PrefixStore(0, 26, key=7, evicted=-1))
    want = store.state_digest(0, drafter=False)
    shared = table(0)[:6] + table(1)[6:]  # the full blocks are shared; the partial block is the sequence's own
    store.carry(CarryOrder(drop=True))
    store.load_prefix(PrefixRestore(1, 7, 26, shared, drafter_first_key=25, drafter_last_key=24, adopt=False))
    assert store.cursors(1).as_tuple()[:4] == (26, 26, 26, 26)
    # the same bytes, drafter aside (the resumed sequence holds no pair keys yet), and the same continuation
    assert store.state_digest(1, drafter=False) == want
    a = feed(b, 0, PROMPT[26:], 26, tables=table(0))
    c = feed(b, 1, PROMPT[26:], 26, step=1, tables=shared)
    assert a == c and store.state_digest(0, drafter=False) == store.state_digest(1, drafter=False)
    with pytest.raises(RestoreRefused):
        store.load_prefix(PrefixRestore(2, 8, 26, shared, 25, 24, False))  # no such snapshot


def test_release_and_reset_forget_everything(store_backend) -> None:
    b = store_backend()
    store = getattr(b, "store", b)
    feed(b, 0, PROMPT, 0, snapshot=RingSnapshot(0, 30, 0))
    store.reset(0)
    assert store.cursors(0).as_tuple() == (0, 0, 0, 0, 0)
    with pytest.raises(RestoreRefused):
        store.restore(RingRestore(0, 0, 30))
    store.release(0)
    store.release(0)  # twice, and unknown sequences, are fine
    store.release(99)
    assert store.cursors(0).as_tuple() == (0, 0, 0, 0, 0)
