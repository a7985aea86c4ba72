"""Issue 13, deliverable 4: a verify commit the backend refuses releases what that verify took and ends only that
request with `error`; the other requests go on, and the engine stays up. One test per path: the verify's drafts
took a new KV block (a 30-token prompt: rows 30..33 cross the block at 32), took none (26: rows 26..29), and a
verify step that fails outright under the full state-digest audit."""

from __future__ import annotations

import pytest
import torch

from atlas.backends.cpu import CpuBackend
from atlas.backends.cpu.store import CpuStateStore
from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.errors import VerifyRefused
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams

CONFIG = EngineConfig(max_seq_len=128, max_batch_size=4, block_size=16, num_drafts=3, drafter="mtp",
                      enable_prefix_caching=False)  # no cache holding blocks: every block is free again at the end
PROMPT = list(b"the refused commit: one request ends, the rest go on.")


def _run(engine: Engine, n: int) -> dict[str, tuple[str, str | None, list[int]]]:
    engine.add_request("a", PROMPT[:n], SamplingParams(max_tokens=10))
    engine.add_request("b", PROMPT[-20:], SamplingParams(max_tokens=10))
    done: dict[str, tuple[str, str | None, list[int]]] = {}
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += list(o.new_token_ids)
            if o.finished:
                done[o.request_id] = (o.finish_reason.value, o.finish_detail, tokens[o.request_id])
    return done


@pytest.fixture(scope="module")
def clean() -> dict[int, dict[str, tuple[str, str | None, list[int]]]]:
    """What each prompt length gives with nothing refused."""
    torch.set_num_threads(1)
    return {n: _run(build_engine("atlas-tiny", "cpu", CONFIG), n) for n in (26, 30)}


def _first_verify_block_span(n: int) -> tuple[int, int]:
    """The blocks the first verify's rows (n .. n + 3) touch: the first and the last."""
    return n // CONFIG.block_size, (n + CONFIG.num_drafts) // CONFIG.block_size


@pytest.mark.parametrize("n", [30, 26], ids=["new-block-taken", "no-new-block"])
def test_a_refused_commit_ends_only_its_request(n: int, clean, monkeypatch: pytest.MonkeyPatch) -> None:
    first, last = _first_verify_block_span(n)
    assert (last > first) == (n == 30)  # the two paths are what their names say
    commit = CpuStateStore.commit
    refused: list[int] = []

    def refuse_first_of_a(self: CpuStateStore, seq_id: int, rows: int):
        if seq_id == 0 and not refused:
            refused.append(rows)
            raise VerifyRefused("injected: the backend declines this commit")
        return commit(self, seq_id, rows)

    monkeypatch.setattr(CpuStateStore, "commit", refuse_first_of_a)
    engine = build_engine("atlas-tiny", "cpu", CONFIG)
    done = _run(engine, n)
    assert refused, "the scenario never verified request a"
    assert not engine.dead
    reason, detail, _ = done["a"]
    assert reason == "error" and "verify commit refused" in (detail or ""), done["a"]
    assert done["b"] == clean[n]["b"]  # the other request is untouched, token for token
    pool = engine.state.pool
    assert len(pool.free) == pool.total and not any(pool.refs), "the refused verify's blocks were not released"
    # the engine serves the next request as if nothing had happened
    again = _run(engine, n)
    assert again == clean[n]


def test_a_failing_verify_step_under_the_full_audit_fails_its_requests_only(clean,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATLAS_STATE_AUDIT", "1")
    verify = CpuBackend.verify
    failed: list[int] = []

    def fail_once(self: CpuBackend, w):
        if not failed:
            failed.append(w.seq_id)
            raise RuntimeError("injected: the verify kernel failed")
        return verify(self, w)

    monkeypatch.setattr(CpuBackend, "verify", fail_once)
    engine = build_engine("atlas-tiny", "cpu", CONFIG)
    assert engine.backend.store.audit
    done = _run(engine, 30)
    assert failed and not engine.dead
    assert any(reason == "error" for reason, _, _ in done.values()), done
    pool = engine.state.pool
    assert len(pool.free) == pool.total and not any(pool.refs)
    assert _run(engine, 30) == clean[30]
