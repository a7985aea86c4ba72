"""The steady decode step on columns (atlas.backends.cuda.steady) against the general path of `CudaBackend.execute`
(`backend.steady = None`), on the CPU path with atlas-tiny: step by step the same StepResult (tokens, outcomes,
cursors, stamps), the same packed group buffer handed to the forward, the same host bookkeeping and the same device
pools, through a run that changes the batch between its steady steps (a sequence joining, finishing, rolled back,
re-prefilled, its block table growing by a block), eager and through the graph path (the replay stood in for by
an eager run of the captured function, the sampler graph by the keyed sampler); and every bad input to a steady
batch refused with the general path's error, nothing moved."""

from __future__ import annotations

import pytest
import torch

from atlas.backends.cuda import CudaBackend
from atlas.config import EngineConfig
from atlas.engine.offline import generate
from atlas.engine.records import RecordingSink
from atlas.model import load_model
from atlas.plan import (
    CarryOrder,
    PrefixRestore,
    PrefixStore,
    RingRestore,
    RingSnapshot,
    SeqWork,
    StepPlan,
    StepResult,
)
from atlas.registry import build_engine
from atlas.sampling.keyed import sample
from atlas.sampling.params import SamplingParams

TINY = load_model("atlas-tiny")
BS = 4  # a small block: tables grow by a block every 4 steps
BLOCKS = 64


class ReplayGraphs:
    """DecodeGraphs' interface on the CPU: a replay runs the captured function (`_decode_logits`) on a copy of the
    packed buffer, as the graph's static input is a copy; the sampler graph's tokens are the keyed sampler's on the
    replay's logits (padding rows greedy), as sample_rows' graph rows are."""

    def __init__(self, backend: CudaBackend) -> None:
        self.backend = backend
        self.logits: dict = {}

    def __len__(self) -> int:
        return len(self.logits)

    def replay(self, shape, packed_host, padding):  # type: ignore[no-untyped-def]
        logits = self.backend._decode_logits(packed_host.clone(), shape)
        self.logits[shape] = logits
        return logits, logits.argmax(dim=-1)

    def sample(self, shape, batch):  # type: ignore[no-untyped-def]
        assert batch.packed.shape[0] == shape.batch
        return sample(self.logits[shape], batch.to("cpu"))


def make(graphs: bool, steady: bool, max_batch_size: int = 4) -> CudaBackend:
    torch.set_num_threads(1)
    backend = CudaBackend(TINY, num_kv_blocks=BLOCKS, block_size=BS, dtype=torch.float32, device="cpu",
                          max_batch_size=max_batch_size, cuda_graphs=False, ring_slots=2, max_blocks_per_seq=16)
    if graphs:
        backend.graphs = ReplayGraphs(backend)  # type: ignore[assignment]
    if not steady:
        backend.steady = None
    # every packed group buffer the forward is handed, as it is then
    fed: list = []
    run = backend._decode_logits

    def recorded(packed, shape):  # type: ignore[no-untyped-def]
        fed.append((shape, packed.clone()))
        return run(packed, shape)

    backend._decode_logits = recorded  # type: ignore[method-assign]
    backend.fed_groups = fed  # type: ignore[attr-defined]
    return backend


def pool_tensors(backend: CudaBackend) -> dict[str, torch.Tensor]:
    """Every tensor the device pools hold (KV, QSA keys, per-slot state, stamps, ring, scratch), by path."""
    out: dict[str, torch.Tensor] = {}

    def walk(name: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{name}[{k}]", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{name}[{i}]", v)

    for name, value in vars(backend.pools).items():
        walk(name, value)
    return out


def host_state(backend: CudaBackend) -> dict:
    return {seq: (s.slot, s.position, list(s.ple_context), s.table, dict(s.ring), s.pending)
            for seq, s in backend._seqs.items()}


def assert_same(fast: CudaBackend, general: CudaBackend) -> None:
    assert host_state(fast) == host_state(general)
    if hasattr(general, "fed_hidden"):  # each chunk's last hidden (the drafter's input)
        assert fast.fed_hidden.keys() == general.fed_hidden.keys()
        assert all(torch.equal(fast.fed_hidden[i], general.fed_hidden[i]) for i in general.fed_hidden)
    prefix = [{k: (e.position, e.ple_context, e.stamps, e.state) for k, e in b.store.prefix.items()}
              for b in (fast, general)]
    assert prefix[0].keys() == prefix[1].keys()
    for k, (position, context, stamps, state) in prefix[0].items():
        other = prefix[1][k]
        assert (position, context) == other[:2] and torch.equal(stamps, other[2]) and state.keys() == other[3].keys()
        assert all(torch.equal(v, other[3][name]) for name, v in state.items())
    a, b = pool_tensors(fast), pool_tensors(general)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert len(fast.fed_groups) == len(general.fed_groups)  # type: ignore[attr-defined]
    for (sa, pa), (sb, pb) in zip(fast.fed_groups, general.fed_groups, strict=True):  # type: ignore[attr-defined]
        assert sa == sb and torch.equal(pa, pb)


class Driver:
    """Builds a run's plans the way the engine does: each sequence's tokens, position and block table (a block
    allocated when the next position needs one: a new, longer tuple)."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.fed: dict[int, int] = {}
        self.tables: dict[int, tuple[int, ...]] = {}
        self.params: dict[int, SamplingParams] = {}
        self.free = list(range(BLOCKS))
        self.step = 0

    def add(self, seq: int, prompt: list[int], params: SamplingParams) -> None:
        self.tokens[seq], self.fed[seq], self.tables[seq], self.params[seq] = list(prompt), 0, (), params

    def table(self, seq: int, end: int) -> tuple[int, ...]:
        while len(self.tables[seq]) * BS < end:
            self.tables[seq] = (*self.tables[seq], self.free.pop(0))
        return self.tables[seq]

    def work(self, seq: int) -> SeqWork:
        start, toks = self.fed[seq], self.tokens[seq][self.fed[seq]:]
        return SeqWork(seq, tuple(toks), start, self.table(seq, start + len(toks)), True, self.params[seq])

    def plan(self, seqs: list[int], **orders: object) -> StepPlan:
        plan = StepPlan(self.step, tuple(self.work(s) for s in seqs), **orders)  # type: ignore[arg-type]
        self.step += 1
        return plan

    def took(self, plan: StepPlan, result: StepResult) -> None:
        for w, o in zip(plan.work, result.outcomes, strict=True):
            self.fed[w.seq_id] = w.end
            self.tokens[w.seq_id].append(o.token)


def both(fast: CudaBackend, general: CudaBackend, plan: StepPlan) -> StepResult:
    got, want = fast.execute(plan), general.execute(plan)
    assert got == want
    assert all(o.token is not None for o in got.outcomes)
    assert_same(fast, general)
    return got


GREEDY, SEEDED = SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=7)


@pytest.mark.parametrize("columns", [False, True], ids=["cells", "columns"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_run_of_steady_steps_equals_the_general_path_step_by_step(graphs: bool, columns: bool) -> None:
    """(columns: the packed buffer and the stamp read's common case by numpy columns at every batch size, as a
    batch of many rows takes them; else cell by cell and by the read's row loop, as a few rows do)"""
    fast, general = make(graphs, True, max_batch_size=6), make(graphs, False, max_batch_size=6)
    general.store.reader.columns_from = 1 << 30  # the reference: the read's row loop
    fast.store.reader.columns_from = 1 if columns else 1 << 30
    fast.steady.columns_from = 1 if columns else 1 << 30  # type: ignore[union-attr]
    d = Driver()
    for seq, prompt in enumerate([list(b"hello there"), list(b"abc"), list(b"0123456789")]):
        d.add(seq, prompt, SEEDED if seq == 1 else GREEDY)

    def step(seqs: list[int], steady: bool, **orders: object) -> StepResult:
        """One plan on both backends (the same result, buffers, pools); `steady`: whether the steady path ran it."""
        before = fast.steady.steps  # type: ignore[union-attr]
        plan = d.plan(seqs, **orders)
        result = both(fast, general, plan)
        d.took(plan, result)
        assert fast.steady.steps == before + steady, d.step - 1  # type: ignore[union-attr]
        return result

    step([0, 1, 2], False)  # prefill
    for _ in range(5):  # steady: tables grow by a block on the way (block size 4: a new, longer tuple)
        step([0, 1, 2], True)
    d.add(3, list(b"xy"), GREEDY)
    step([0, 3, 1, 2], False)  # 3 joins with its prefill chunk
    for _ in range(3):
        step([0, 3, 1, 2], True)
    step([0, 3, 2], False, release=(1,))  # 1 finishes
    step([0, 3, 2], True)
    at = d.fed[0] + 1  # a ring snapshot of 0 where this step's work ends
    step([0, 3, 2], False, snapshots=(RingSnapshot(0, at, 0),))
    for _ in range(3):
        step([0, 3, 2], True)
    # 0 rolled back to the snapshot (its tokens past it dropped), then fed from there
    step([3, 2], False, restores=(RingRestore(0, 0, at),))  # (no re-feed this step)
    d.tokens[0], d.fed[0] = d.tokens[0][: at + 1], at
    for _ in range(3):
        step([0, 3, 2], True)  # the batch kept: 0 fed at its restored position
    step([0, 3], False, reset=(2,))  # 2 preempted: its state reset, no work for it this step
    d.fed[2] = 0  # and re-prefilled: prompt and generated tokens from position 0
    step([0, 3, 2], False)
    for _ in range(3):
        step([2, 0, 3], True)  # the same sequences in another order: another batch
    # 0 and 3 finish and come back under the same ids, fed through the same table objects: other SeqStates, in other
    # slots (the freed slots are taken lowest first, 3 first), so the kept batch's packed slots are stale
    # two blocks ahead for each, which the batch keeps: the same table objects over the next six steps, through which
    # the group's key blocks grow (a new shape, the same batch)
    for seq in (0, 2, 3):
        d.tables[seq] = (*d.tables[seq], d.free.pop(0), d.free.pop(0))
    step([2, 0, 3], True)
    kept = fast.steady.tables  # type: ignore[union-attr]
    # 0 and 3 finish and come back under the same ids, fed through the same table objects: other SeqStates, in other
    # slots (the freed slots are taken lowest first, 3 first), so the kept batch's packed slots are stale
    slots = {seq: fast._seqs[seq].slot for seq in (0, 3)}
    d.fed[0] = d.fed[3] = 0
    step([3, 0, 2], False, release=(0, 3))
    assert all(fast._seqs[seq].slot != slots[seq] for seq in (0, 3))
    shapes = set()
    for _ in range(4):
        step([2, 0, 3], True)
        shapes.add(fast.steady.shape)  # type: ignore[union-attr]
    assert all(a is b for a, b in zip(kept, (d.tables[2], d.tables[0], d.tables[3]), strict=True))
    assert len(shapes) == (1 if graphs else 2)  # (the graphs' key blocks are bucketed: 16 throughout)
    # 2 reset outside a plan, then fed one token at 0: a fresh sequence, which the general path resets
    for backend in (fast, general):
        backend.reset(2)
    d.tokens[2], d.fed[2] = d.tokens[2][:1], 0
    step([2, 0, 3], False)
    step([2, 0, 3], True)
    d.add(4, [9], GREEDY)  # a one-token prompt of a new sequence
    step([2, 0, 3, 4], False)
    for _ in range(2):
        step([2, 0, 3, 4], True)
    # a row asking logprobs, and the steady step after it
    d.params[3] = SamplingParams(logprobs=True, top_logprobs=2)
    step([2, 0, 3, 4], False)
    d.params[3] = GREEDY
    step([2, 0, 3, 4], True)
    # a prefix snapshot of 0 where it stands; a new sequence 5 started from it (no work for it that step), its table
    # the snapshot's full blocks and a tail block of its own; then fed in the batch
    at = d.fed[0]
    step([2, 0, 3, 4], False, prefix_stores=(PrefixStore(0, at, 77, -1),))
    step([2, 0, 3, 4], True)
    d.add(5, d.tokens[0][: at + 1], GREEDY)
    d.fed[5], d.tables[5] = at, (*d.tables[0][: at // BS], d.free.pop(0))
    step([2, 0, 3, 4], False, prefix_restores=(PrefixRestore(5, 77, at, d.tables[5], 0, -1, False),))
    for _ in range(2):
        step([2, 0, 3, 4, 5], True)
    assert max(len(t) for t in d.tables.values()) >= 6  # tables grew block by block


def test_an_engine_run_gives_the_general_paths_tokens_and_events() -> None:
    """The engine (its batch columns move last step's SeqWork objects in place) over the steady path and over the
    general path: the same tokens and the same trace, event by event."""

    def run(steady: bool) -> tuple[list, list]:
        sink = RecordingSink()
        engine = build_engine("atlas-tiny", "cuda-fp32", EngineConfig(max_seq_len=96, max_batch_size=3,
                                                                     prefill_chunk_tokens=16), loaded=TINY,
                              sink=sink, full_audit=True, backend_options={"device": "cpu", "cuda_graphs": False})
        if not steady:
            engine.backend.steady = None  # type: ignore[attr-defined]
        params = [SamplingParams(max_tokens=30, ignore_eos=True),
                  SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
                  SamplingParams(max_tokens=40, ignore_eos=True)]
        out = [r.token_ids for r in generate(engine, [list(b"hello"), list(b"a longer prompt here"), [1, 2]], params)]
        if steady:
            assert engine.backend.steady.steps > 20  # type: ignore[attr-defined]
        return out, [(index, step, e, digest) for index, step, e, digest in sink.rows]

    assert run(True) == run(False)


def steady_pair(graphs: bool = False) -> tuple[CudaBackend, CudaBackend, Driver]:
    """Two backends (steady path on, off) with three sequences a few steady steps in, the batch kept."""
    fast, general = make(graphs, True), make(graphs, False)
    d = Driver()
    for seq, prompt in enumerate([list(b"hello there"), list(b"abc"), list(b"0123456789")]):
        d.add(seq, prompt, GREEDY)
    for _ in range(3):
        plan = d.plan([0, 1, 2])
        d.took(plan, both(fast, general, plan))
    assert fast.steady.ids == (0, 1, 2) and fast.steady.steps == 2  # type: ignore[union-attr]
    return fast, general, d


def refused_alike(fast: CudaBackend, general: CudaBackend, plan: StepPlan, match: str) -> None:
    """Both backends refuse `plan` with the same error, having moved nothing (host bookkeeping, pools, no forward)."""
    host = host_state(fast)
    pools = {k: v.clone() for k, v in pool_tensors(fast).items()}
    fed = len(fast.fed_groups)  # type: ignore[attr-defined]
    steps = fast.steady.steps  # type: ignore[union-attr]
    errors = []
    for backend in (fast, general):
        with pytest.raises(ValueError, match=match) as caught:
            backend.execute(plan)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
    assert fast.steady.steps == steps  # type: ignore[union-attr]
    assert host_state(fast) == host
    assert len(fast.fed_groups) == fed  # type: ignore[attr-defined]
    for name, tensor in pool_tensors(fast).items():
        assert torch.equal(tensor, pools[name]), name
    assert_same(fast, general)


def with_row(plan: StepPlan, i: int, **changes: object) -> StepPlan:
    import attrs

    work = list(plan.work)
    work[i] = attrs.evolve(work[i], **changes)
    return attrs.evolve(plan, work=tuple(work))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_every_bad_input_to_a_steady_batch_is_refused_with_the_general_paths_error(graphs: bool) -> None:
    fast, general, d = steady_pair(graphs)
    vocab = TINY.spec.vocab_size
    plan = d.plan([0, 1, 2])
    w = plan.work[1]
    refused_alike(fast, general, with_row(plan, 1, tokens=(vocab,)), "outside the vocabulary")
    refused_alike(fast, general, with_row(plan, 1, tokens=(-1,)), "outside the vocabulary")
    refused_alike(fast, general, with_row(plan, 1, tokens=()), "empty chunk")
    refused_alike(fast, general, with_row(plan, 1, start=w.start + 1), "but the backend holds")
    refused_alike(fast, general, with_row(plan, 1, start=w.start - 1), "but the backend holds")
    short = w.block_table[: -(-(w.start + 1) // BS) - 1]
    refused_alike(fast, general, with_row(plan, 1, block_table=short), "block table has")
    refused_alike(fast, general, with_row(plan, 1, block_table=(*w.block_table[:-1], BLOCKS)), "outside")
    refused_alike(fast, general, with_row(plan, 1, block_table=(-1, *w.block_table[1:])), "outside")
    # a block outside the pool past the blocks the positions need: the group's key slots, the sentinel and the stamp
    # read read it (checking the first `needed` only, the general path failed mid-step)
    refused_alike(fast, general, with_row(plan, 1, block_table=(*w.block_table, BLOCKS + 3)), "outside")
    refused_alike(fast, general, with_row(plan, 1, block_table=(*w.block_table, -1)), "outside")
    refused_alike(fast, general, StepPlan(plan.step, (*plan.work, plan.work[1])), "at most once")
    refused_alike(fast, general, StepPlan(plan.step, (*plan.work, SeqWork(9, (5,), 3, (40,), True))),
                  "starts at 3 but the backend holds 0")
    fresh = tuple(SeqWork(10 + i, (5,), 0, (50 + i,), True) for i in range(2))
    refused_alike(fast, general, StepPlan(plan.step, (*plan.work, *fresh)), "only 1 state slots are free")
    # the batch is still steady: the good plan runs on the steady path, equal to the general one
    steps = fast.steady.steps  # type: ignore[union-attr]
    d.took(plan, both(fast, general, plan))
    assert fast.steady.steps == steps + 1  # type: ignore[union-attr]


def test_a_table_object_that_runs_out_is_refused_on_the_steady_path() -> None:
    """The same block table object step after step (its blocks checked once) until the fed position needs a block
    it does not have: refused there with the general path's error, nothing moved."""
    fast, general, d = steady_pair()
    kept, ran = d.tables[0], 0
    while d.fed[0] + 1 <= len(kept) * BS:  # fed through the same table object while it covers the fed position
        plan = with_row(d.plan([0, 1, 2]), 0, block_table=kept)
        d.took(plan, both(fast, general, plan))
        ran += 1
    assert ran >= 2
    assert fast.steady.tables[0] is kept  # type: ignore[union-attr]
    refused_alike(fast, general, with_row(d.plan([0, 1, 2]), 0, block_table=kept), "block table has")


def test_rows_the_steady_path_does_not_run_give_the_general_paths_results() -> None:
    """A steady batch's plan with one row that is not a plain sampled decode (not sampled, a ban): run by the
    general path, the same result; a row's drafter key and a carry order, which nothing reads without a drafter:
    run by the steady path, the same result."""
    fast, general, d = steady_pair()
    vocab = TINY.spec.vocab_size
    only = tuple(t for t in range(vocab) if t != 5)  # a ban of every token but 5
    for change in ({"sample": False}, {"banned": only}, {"drafter_first_key": 3}):
        plan = d.plan([0, 1, 2])
        steps = fast.steady.steps  # type: ignore[union-attr]
        got = fast.execute(with_row(plan, 2, **change))
        assert got == general.execute(with_row(plan, 2, **change))
        assert_same(fast, general)
        if "drafter_first_key" in change:  # (without a drafter the key is not read: a steady step)
            assert fast.steady.steps == steps + 1  # type: ignore[union-attr]
        else:
            assert fast.steady.steps == steps  # type: ignore[union-attr]
        if "banned" in change:
            assert got.outcomes[2].token == 5
        if "sample" in change:
            assert got.outcomes[2].token is None
            got = attrs_token(got, 2, 7)
        d.took(plan, got)
    # a carry order without a drafter moves nothing (CudaStateStore.carry): a steady step all the same
    plan = d.plan([0, 1, 2], carry=CarryOrder(drop=True, store=1))
    steps = fast.steady.steps  # type: ignore[union-attr]
    d.took(plan, both(fast, general, plan))
    assert fast.steady.steps == steps + 1  # type: ignore[union-attr]


def attrs_token(result: StepResult, i: int, token: int) -> StepResult:
    """`result` with outcome i's token set (a row that sampled none: the driver feeds `token` next)."""
    import attrs

    outcomes = list(result.outcomes)
    outcomes[i] = attrs.evolve(outcomes[i], token=token)
    return attrs.evolve(result, outcomes=tuple(outcomes))


def test_a_decode_row_asking_prompt_logprobs_goes_the_general_way() -> None:
    """(The general path refuses it after its forward, having no logits of the position before: the steady path
    must not run it as a plain decode.)"""
    fast, general, d = steady_pair()
    bad = with_row(d.plan([0, 1, 2]), 2, prompt_logprobs=1)
    for backend in (fast, general):
        with pytest.raises(ValueError, match="prompt logprobs at 12 need the logits of position 11"):
            backend.execute(bad)
    assert_same(fast, general)


def test_a_backend_with_a_drafter_runs_every_step_the_general_way() -> None:
    """The MTP drafter is fed every plain row's hidden after the forward: its backend never takes the steady path."""
    backends = []
    for steady in (True, False):
        backend = CudaBackend(TINY, num_kv_blocks=BLOCKS, block_size=BS, dtype=torch.float32, device="cpu",
                              max_batch_size=2, cuda_graphs=False, mtp_drafter=True, verify_width=2)
        if not steady:
            backend.steady = None
        backends.append(backend)
    fast, general = backends
    tables = [tuple(range(8)), tuple(range(8, 16))]
    plan = StepPlan(0, tuple(SeqWork(i, (1, 2, 3), 0, tables[i], True) for i in range(2)))
    for step in range(1, 5):
        got = fast.execute(plan)
        assert got == general.execute(plan)
        plan = StepPlan(step, tuple(SeqWork(i, (o.token,), 2 + step, tables[i], True)
                                    for i, o in enumerate(got.outcomes)))
    assert fast.steady.steps == 0  # type: ignore[union-attr]
    assert fast.store.state_digest(0) == general.store.state_digest(0)
