"""The fast stamp read (atlas.backends.cuda.stamp_read) gives exactly the BackendCursors of the reference read it
replaced (`CudaStateStore.read_cursors_reference`): at every read of engine runs with speculation (pending verify
rows left past each commit), a watchdog rollback (ring restores) and multi-turn prefix hits (prefix loads, the
drafter carry), and on random states: stamps overwritten with right, wrong, pending and cleared positions, tables
that grow, shrink, move and end in the scratch (sentinel) block, sequences released and slots reused, random
subsets asked; eager and through the graph path's delta logic (the replay stood in for by an eager run)."""

from __future__ import annotations

import random

import pytest
import torch
from test_cuda_features import (
    CPU_PATH,
    OPENERS,
    PROMPTS,
    SESSION,
    TINY,
    _looping,
    _prefix_config,
    cuda_engine,
    greedy,
    loop_run,
)
from test_prefix_sessions import run_script
from test_rollback_engine import config as loop_config

from atlas.backends.cuda import CudaBackend
from atlas.backends.cuda.stamp_read import ENTRIES
from atlas.config import EngineConfig, derive_capacities
from atlas.plan import SeqWork, StepPlan


def checked(store) -> dict[str, int]:
    """Every read of `store` also runs the reference and asserts the two agree: read_cursors, and read_held (which
    read_cursors and the steady decode step, atlas.backends.cuda.steady, call with the states in hand)."""
    fast, fast_held, seen = store.read_cursors, store.read_held, {"reads": 0, "seqs": 0}

    def both(seq_ids):
        got, want = fast(seq_ids), store.read_cursors_reference(seq_ids)
        assert got == want
        return got

    def both_held(key, live, states):
        got = fast_held(key, live, states)
        assert dict(zip(live, got, strict=True)) == store.read_cursors_reference(list(live))
        seen["reads"] += 1
        seen["seqs"] += len(got)
        return got

    store.read_cursors, store.read_held = both, both_held
    return seen


class EagerGraph:
    """The graph path on the CPU: `_capture` returns this, whose replay runs the captured function eagerly with
    the static delta applied (what the CUDA graph does), so the delta bookkeeping is exercised."""

    def __init__(self, reader, key) -> None:
        self.reader, self.key, self.graph = reader, key, self
        self.out = reader._summary(*key, delta=True)

    def replay(self) -> None:
        self.out = self.reader._summary(*self.key, delta=True)


def graph_path(store) -> None:
    reader = store.reader
    reader.use_graphs = True
    reader._capture = lambda key: reader._graphs.setdefault(key, EagerGraph(reader, key))


@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
def test_every_read_of_a_speculative_run_equals_the_reference(columns: bool) -> None:
    """(columns: every read's common case by numpy columns, as a read of many rows takes it)"""
    engine = cuda_engine(EngineConfig(max_seq_len=160, max_batch_size=3, prefill_chunk_tokens=32, num_drafts=3,
                                      drafter="mtp"))
    engine.backend.store.reader.columns_from = 1 if columns else 1 << 30  # type: ignore[attr-defined]
    seen = checked(engine.backend.store)  # type: ignore[attr-defined]
    greedy(engine, PROMPTS, 20)
    assert seen["reads"] >= 10 and seen["seqs"] >= 30
    assert engine.stats().spec_drafts_proposed > engine.stats().spec_drafts_accepted  # rows were rejected


def test_every_read_of_a_rollback_run_equals_the_reference() -> None:
    cfg = loop_config()
    caps = derive_capacities(cfg, TINY.spec, activation_bytes=4)
    backend = CudaBackend.for_capacities(TINY, caps, dtype=torch.float32, name="cuda-fp32", **CPU_PATH)
    seen = checked(backend.store)
    engine = _looping(backend, cfg, caps)
    loop_run(engine)
    assert engine.stats().rollbacks_total == 2 and seen["reads"] > 20


@pytest.mark.parametrize("graphs", [False, True])
def test_every_read_of_a_prefix_session_equals_the_reference(graphs: bool) -> None:
    engine = cuda_engine(_prefix_config(True, 2))
    store = engine.backend.store  # type: ignore[attr-defined]
    if graphs:
        graph_path(store)
    seen = checked(store)
    run_script(engine, SESSION, OPENERS)
    assert engine.stats().prefix_cache_hits >= 2 and seen["reads"] > 20


def _backend(drafter: bool) -> CudaBackend:
    return CudaBackend(TINY, num_kv_blocks=40, block_size=4, dtype=torch.float32, max_batch_size=6, device="cpu",
                       cuda_graphs=False, mtp_drafter=drafter, verify_width=3, max_blocks_per_seq=12)


def _scramble(backend: CudaBackend, rng: random.Random) -> None:
    """Random stamp and table damage of every kind the read must report as the reference does."""
    pools, store = backend.pools, backend.store
    view = pools.paged_pos.view(len(pools.paged_kinds), -1)
    for _ in range(rng.randrange(1, 12)):
        kind, cell = rng.randrange(view.shape[0]), rng.randrange(view.shape[1])  # the scratch block's rows too
        p = rng.randrange(40)
        view[kind, cell] = rng.choice([p, -1, -(p + 2), cell % 48, 0])
    for _ in range(rng.randrange(4)):
        pools.stamps[rng.randrange(pools.stamps.shape[0]), rng.randrange(pools.stamps.shape[1])] = rng.randrange(-1, 40)
    if backend.drafter is not None:
        pos = backend.drafter.pos
        for _ in range(rng.randrange(4)):
            r = rng.randrange(pos.shape[1])
            pos[rng.randrange(pos.shape[0]), r] = rng.choice([r, -1, -(r + 2), r + 1])
    for s in list(store.seqs.values()):
        roll = rng.random()
        if roll < 0.15:
            s.table = s.table + (rng.randrange(40),)  # a block appended
        elif roll < 0.25:
            s.table = s.table[: rng.randrange(len(s.table) + 1)]  # shrunk (a rollback's freed blocks)
        elif roll < 0.3:
            s.table = tuple(rng.randrange(41) for _ in range(rng.randrange(1, 13)))  # moved, maybe the scratch block


@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("drafter", [False, True])
@pytest.mark.parametrize("graphs", [False, True])
def test_the_fast_read_equals_the_reference_on_random_states(drafter: bool, graphs: bool, columns: bool) -> None:
    """(columns: every read's common case by numpy columns, as a read of many rows takes it; else by the row loop)"""
    backend = _backend(drafter)
    store = backend.store
    store.reader.columns_from = 1 if columns else 1 << 30
    if graphs:
        graph_path(store)
    rng = random.Random(13 + drafter + 2 * graphs)
    seq_ids = list(range(8))
    fed: dict[int, int] = {}
    for round_ in range(60):
        if round_ % 10 == 0:  # release some, start others on reused slots (prefill chunks of random lengths)
            for s in [s for s in list(store.seqs) if rng.random() < 0.4]:
                backend.release(s)
                fed.pop(s, None)
            work = []
            blocks = iter(rng.sample(range(40), 40))
            for s in rng.sample(seq_ids, 3):
                if s in store.seqs or len(store.seqs) + len(work) >= 5:
                    continue
                n = rng.randrange(2, 20)
                table = tuple(next(blocks) for _ in range(-(-n // 4) + rng.randrange(2)))
                work.append(SeqWork(s, tuple(rng.randrange(200) for _ in range(n)), 0, table, True))
                fed[s] = n
            if work:
                backend.execute(StepPlan(round_, tuple(work)))
        _scramble(backend, rng)
        asked = rng.sample(seq_ids, rng.randrange(1, len(seq_ids)))  # unknown sequences among them
        assert store.read_cursors(asked) == store.read_cursors_reference(asked)
    assert fed  # sequences were live


def test_more_table_changes_than_a_replay_takes_are_applied_first() -> None:
    """A read whose tables changed in more than ENTRIES cells (a long prompt's first read) applies them eagerly
    and makes the graph's delta a no-op: the delta left by the read before (blocks 1, 2) must not come back over
    the new table (blocks 5, 6, ...: nothing stamped there, so the run is 0)."""
    backend = CudaBackend(TINY, num_kv_blocks=100, block_size=4, dtype=torch.float32, max_batch_size=2, device="cpu",
                          cuda_graphs=False, max_blocks_per_seq=90)
    store = backend.store
    graph_path(store)
    backend.execute(StepPlan(0, (SeqWork(0, tuple(range(8)), 0, (1, 2), True),)))
    assert store.read_cursors([0])[0].kv_tokens == 8 and not store.reader.delta_dummy  # a delta the "graph" applied
    s = store.seqs[0]
    s.table = (5, 6) + tuple(range(10, 10 + ENTRIES))  # more than ENTRIES cells at once
    assert store.read_cursors([0]) == store.read_cursors_reference([0])
    assert store.read_cursors([0])[0].kv_tokens == 0 and store.reader.delta_dummy
    s.table = (1, 2)  # and back: a small delta again
    assert store.read_cursors([0]) == store.read_cursors_reference([0]) and store.read_cursors([0])[0].kv_tokens == 8


def test_a_table_past_the_device_rows_resends_every_asked_sequence() -> None:
    """One sequence's table outgrows the device rows (they are widened and cleared): the read re-sends every
    asked sequence's table, also those whose tables did not change since the last read."""
    for graphs in (False, True):
        backend = CudaBackend(TINY, num_kv_blocks=60, block_size=4, dtype=torch.float32, max_batch_size=2,
                              device="cpu", cuda_graphs=False, max_blocks_per_seq=4)
        store = backend.store
        if graphs:
            graph_path(store)
        backend.execute(StepPlan(0, (SeqWork(0, tuple(range(6)), 0, (3, 4), True),
                                     SeqWork(1, tuple(range(7)), 0, (5, 6), True))))
        assert [c.kv_tokens for c in store.read_cursors([0, 1]).values()] == [6, 7]
        cols = store.reader.cols
        store.seqs[0].table = (3, 4) + tuple(range(20, 20 + cols))  # past the rows; sequence 1 unchanged
        assert store.read_cursors([0, 1]) == store.read_cursors_reference([0, 1])
        assert store.reader.cols > cols and store.read_cursors([1])[1].kv_tokens == 7


def test_a_prefetched_read_serves_its_own_read_only() -> None:
    """A plain step starts its stamp read behind the forward (store.prefetch); the read it serves must equal a
    fresh one, a store write in between drops it, and a read of other sequences ignores it."""
    backend = _backend(False)
    store = backend.store
    backend.execute(StepPlan(0, (SeqWork(0, tuple(range(6)), 0, (3, 4), True), SeqWork(1, tuple(range(5)), 0, (5, 6),
                                                                                      True))))
    assert store.reads.prefetch_seconds > 0 and store._launched is None  # started early, then used by the step
    store.prefetch([0, 1])
    assert store.read_cursors([0, 1]) == store.read_cursors_reference([0, 1])
    store.prefetch([0, 1])
    store.reset(0)  # a write through the store: the started read is stale
    assert store._launched is None
    got = store.read_cursors([0, 1])
    assert got == store.read_cursors_reference([0, 1]) and got[0].kv_tokens == 0 and got[1].kv_tokens == 5
    store.prefetch([1])
    assert store.read_cursors([0, 1]) == store.read_cursors_reference([0, 1])  # other ids: read anew


def test_a_healthy_sequences_cursors_are_shared_and_a_damaged_ones_named() -> None:
    backend = _backend(False)
    store = backend.store
    backend.execute(StepPlan(0, (SeqWork(0, tuple(range(6)), 0, (3, 4), True), SeqWork(1, tuple(range(6)), 0, (5, 6),
                                                                                      True))))
    a, b = store.read_cursors([0, 1]).values()
    assert a is b and a.kv_tokens == 6 and {p for _, _, p in a.stamps} == {6}  # one position: one shared object
    backend.pools.stamp["gdn1"][store.seqs[1].slot] = 5  # one GDN layer one token behind
    a, b = store.read_cursors([0, 1]).values()
    assert b.ssm_position == 5 and ("gdn", 1, 5) in b.stamps and a.ssm_position == 6
    assert store.read_cursors([0, 1]) == store.read_cursors_reference([0, 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA graph of the read needs a GPU")
@pytest.mark.parametrize("backend", ["cuda", "cuda-fp32"])
def test_on_the_gpu_the_graph_read_equals_the_reference(backend: str) -> None:
    """The real thing: the summary captured and replayed as CUDA graphs (with the decode graphs), every read of
    a speculative run and of a prefix session checked against the reference."""
    from atlas.engine.records import RecordingSink
    from atlas.registry import build_engine

    runs = [(EngineConfig(max_seq_len=160, max_batch_size=3, prefill_chunk_tokens=32, num_drafts=3, drafter="mtp"),
             lambda e: greedy(e, PROMPTS, 20))]
    if backend == "cuda-fp32":  # run_script compares each turn with the CPU reference's tokens: fp32 parity only
        runs.append((_prefix_config(True, 2), lambda e: run_script(e, SESSION, OPENERS)))
    for config, run in runs:
        engine = build_engine("atlas-tiny", backend, config, loaded=TINY, sink=RecordingSink(), full_audit=True,
                              backend_options={"device": "cuda", "cuda_graphs": True})
        store = engine.backend.store  # type: ignore[attr-defined]
        assert store.reader.use_graphs
        seen = checked(store)
        run(engine)
        assert seen["reads"] > 10 and store.reader._graphs  # replayed from captured graphs
