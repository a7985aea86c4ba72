"""The state-digest audit on the CUDA backend (cuda-fp32 on CPU tensors): each check fires on an injected desync
of the kind it exists for, one the position stamps cannot see (the bytes are wrong, every stamp is right), at
the step that made it, as machine "StateDigest"; honest runs (speculation row by row and wide, a watchdog
rollback, prefix hits) pass with the audit comparing digests; with the audit off nothing is digested."""

from __future__ import annotations

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

import atlas.backends.cuda.store as cuda_store
from atlas.backends.cuda import CudaBackend
from atlas.config import EngineConfig, derive_capacities
from atlas.engine.records import RecordingSink
from atlas.errors import InvariantViolation
from atlas.registry import AUDITED_BACKENDS, CUDA_BACKENDS, build_engine
from atlas.state.events import InvariantViolated

SPEC = EngineConfig(max_seq_len=160, max_batch_size=3, prefill_chunk_tokens=32, num_drafts=3, drafter="mtp")


def spec_engine(**options):
    return build_engine("atlas-tiny", "cuda-fp32", SPEC, loaded=TINY, sink=RecordingSink(), full_audit=True,
                        backend_options={**CPU_PATH, **options})


def violations(engine) -> list[InvariantViolated]:
    return [e for _, _, e, _ in engine.sink.rows if isinstance(e, InvariantViolated)]


def caught(engine, run, what: str, differs: list[str]) -> None:
    """`run(engine)` ends in a StateDigest violation whose message names `what` and whose fields name exactly
    the state parts that differ (`differs`)."""
    with pytest.raises(InvariantViolation):
        run(engine)
    (v,) = violations(engine)
    assert v.machine == "StateDigest" and what in v.message, (v.machine, v.message)
    assert v.fields["differs"] == differs, v.fields


def looping_engine(audit: bool = True):
    cfg = loop_config()
    caps = derive_capacities(cfg, TINY.spec, activation_bytes=4)
    backend = CudaBackend.for_capacities(TINY, caps, dtype=torch.float32, name="cuda-fp32", state_audit=audit,
                                         **CPU_PATH)
    return _looping(backend, cfg, caps)


def test_every_cuda_mode_is_audited_and_replay_turns_it_on() -> None:
    assert set(CUDA_BACKENDS) <= set(AUDITED_BACKENDS)
    assert cuda_engine(SPEC).backend.store.audit is not None  # type: ignore[attr-defined]  (ATLAS_STATE_AUDIT=1)


# -- honest runs: the audit compares and passes --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["rows", "wide"])
def test_an_honest_speculative_run_passes_the_audit(mode: str) -> None:
    engine = spec_engine(verify_mode=mode)
    greedy(engine, PROMPTS, 16)
    audit = engine.backend.store.audit  # type: ignore[attr-defined]
    assert not violations(engine) and audit.checks >= 20  # commits and their hiddens compared


def test_an_honest_rollback_and_prefix_session_pass_the_audit() -> None:
    engine = looping_engine()
    loop_run(engine)
    assert engine.stats().rollbacks_total == 2 and engine.backend.store.audit.checks >= 2  # type: ignore[attr-defined]
    engine = cuda_engine(_prefix_config(True, 2))
    run_script(engine, SESSION, OPENERS)
    assert engine.stats().prefix_cache_hits >= 2 and engine.backend.store.audit.checks >= 2  # type: ignore[attr-defined]


# -- injected desyncs, each caught -----------------------------------------------------------------------------


def skipping(pools, method: str, name: str) -> None:
    """pools.<method> copies every state back but leaves `name`'s bytes as they were (its stamp still moves)."""
    inner = getattr(pools, method)

    def broken(*args) -> None:
        kept = pools.state[name].clone()
        inner(*args)
        stamp = pools.stamps[pools.index[name]].clone()
        pools.state[name].copy_(kept)
        pools.stamps[pools.index[name]].copy_(stamp)

    setattr(pools, method, broken)


def test_a_ring_restore_that_leaves_one_gdn_state_untouched_is_caught() -> None:
    engine = looping_engine()
    skipping(engine.backend.pools, "ring_load", "gdn1")  # type: ignore[attr-defined]
    caught(engine, loop_run, "ring restore", ["gdn1"])


def test_a_prefix_load_that_leaves_the_ple_conv_state_untouched_is_caught() -> None:
    engine = cuda_engine(_prefix_config(True, 0))
    pools = engine.backend.pools  # type: ignore[attr-defined]
    name = next(n for n in pools.names if n.startswith("conv"))
    skipping(pools, "load_slot", name)
    caught(engine, lambda e: run_script(e, SESSION, OPENERS), "prefix restore", [name])


@pytest.mark.parametrize("mode", ["rows", "wide"])
def test_a_commit_that_keeps_a_rejected_rows_gdn_state_is_caught(mode: str) -> None:
    """The commit installs the GDN state of the row after the last kept one (a rejected draft's), its stamp the
    kept row's: every stamp right, the bytes a rejected token's."""
    engine = spec_engine(verify_mode=mode)
    pools = engine.backend.pools  # type: ignore[attr-defined]
    inner, name = pools.inter_load, "gdn1"

    def broken(slots, rows) -> None:
        rejected = rows + 1
        if pools.kept:
            per_token, _, kslots = pools.kept[name]
            b = (kslots[None, :] == slots[:, None]).to(torch.int8).argmax(dim=1)
            state = per_token[rejected.clamp(max=per_token.shape[0]) - 1, b].clone()
        else:
            state = pools.inter[name][rejected.clamp(max=pools.verify_width), slots].clone()
        inner(slots, rows)
        pools.state[name][slots] = state.to(pools.state[name].dtype)

    pools.inter_load = broken
    caught(engine, lambda e: greedy(e, PROMPTS, 16), "verify commit", ["gdn1"])


def test_drafter_rows_built_from_another_hidden_are_caught() -> None:
    """The commit hands the drafter the verify's hidden rows in the wrong order (every count right)."""
    engine = cuda_engine(SPEC)
    store = engine.backend.store  # type: ignore[attr-defined]
    inner = store.record_verify

    def broken(seq_id: int, hidden: torch.Tensor) -> None:
        inner(seq_id, hidden)
        store.pending_hidden[seq_id] = hidden.roll(1, dims=0)

    store.record_verify = broken
    caught(engine, lambda e: greedy(e, PROMPTS, 16), "drafter rows of a verify commit", ["hidden"])


def test_with_the_audit_off_nothing_is_digested_and_the_desync_goes_unseen(monkeypatch) -> None:
    """Audit off: no digest is computed on any path (the restore, the commit), and the ring-restore desync above
    passes every stamp check: only the audit sees it."""
    def never(*_args):
        raise AssertionError("a digest was computed with the audit off")

    monkeypatch.setattr(cuda_store, "slot_digest", never)
    monkeypatch.setattr(cuda_store, "verify_row_digests", never)
    engine = looping_engine(audit=False)
    assert engine.backend.store.audit is None  # type: ignore[attr-defined]
    skipping(engine.backend.pools, "ring_load", "gdn1")  # type: ignore[attr-defined]
    loop_run(engine)
    assert engine.stats().rollbacks_total == 2 and not violations(engine)
    engine = spec_engine(state_audit=False)
    greedy(engine, PROMPTS[:1], 8)
    assert engine.stats().spec_drafts_proposed and not violations(engine)
