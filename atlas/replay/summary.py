"""`atlas trace show`: what a trace says happened, computed from its events alone."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import attrs

from atlas.errors import TraceFileError
from atlas.replay.reader import RunEnd, TraceReader
from atlas.replay.run_rows import RunRecord
from atlas.sampling.acceptance import AcceptanceStats


@attrs.define
class RequestSummary:
    request_id: str
    seq_id: int
    prompt_tokens: int
    arrival_step: int
    completion_tokens: int = 0
    finish_reason: str | None = None  # None: still running when the trace ended
    finish_detail: str = ""
    finish_step: int | None = None
    preemptions: int = 0
    rollbacks: int = 0  # content-loop rollbacks taken (each drops the tokens past its `keep`)
    prefix_cached: int = 0  # prefill tokens a prefix-cache hit resumed past (0: cold)
    carry_rows: int = 0  # MTP drafter rows it kept from the carried entry


@attrs.frozen
class TraceSummary:
    run: RunRecord
    events: int
    steps: int
    event_counts: dict[str, int]
    requests: list[RequestSummary]
    faults: list[str]
    # speculative decoding, from step_planned drafts and step_executed verdict bits (AcceptanceStats.summary);
    # None when nothing drafted
    speculation: dict | None = None
    # prefix caching and the drafter carry (hits, tokens saved and replayed, carry stored/adopted/released);
    # None when the trace has none of their events
    prefix: dict | None = None
    # how the recording ended: `truncated` when the run never wrote its run-end marker (kill -9, a full disk)
    end: RunEnd | None = None

    @property
    def outcome_counts(self) -> dict[str, int]:
        return dict(Counter(r.finish_reason or "unfinished" for r in self.requests))


def summarize(path_or_url: str | Path, run_id: int | None = None) -> TraceSummary:
    reader = TraceReader(path_or_url)
    try:
        run = reader.run(run_id)
        counts: Counter[str] = Counter()
        by_seq: dict[int, RequestSummary] = {}
        faults: list[str] = []
        planned: tuple[int, ...] = ()
        drafts: list[list[int]] = []
        accept = AcceptanceStats()
        latched = 0
        prefix: Counter[str] = Counter()
        steps = 0
        n = 0
        rec = None
        try:
            for rec in reader.events(run.run_id):
                n += 1
                counts[rec.kind] += 1
                p = rec.payload
                if rec.kind == "request_arrived":
                    by_seq[p["seq_id"]] = RequestSummary(p["request_id"], p["seq_id"], len(p["prompt"]), rec.step)
                elif rec.kind == "step_planned":
                    planned = tuple(p["seqs"])
                    drafts = p.get("drafts") or [[]] * len(planned)
                    steps = max(steps, p["step"] + 1)
                elif rec.kind == "step_executed":
                    accepted = p.get("accepted") or [0] * len(planned)
                    bits = p.get("verdicts") or [0] * len(planned)
                    for seq_id, token, d, a, b in zip(planned, p["tokens"], drafts, accepted, bits, strict=True):
                        if token >= 0:
                            by_seq[seq_id].completion_tokens += 1 + a
                        if d and a >= 0:
                            accept.record(len(d), b)
                elif rec.kind == "speculation_latched_off":
                    latched += 1
                elif rec.kind == "rolled_back":
                    r = by_seq[p["seq_id"]]
                    r.rollbacks += 1
                    r.completion_tokens = p["keep"] - r.prompt_tokens
                elif rec.kind == "sequence_preempted":
                    by_seq[p["seq_id"]].preemptions += 1
                elif rec.kind == "prefix_cache_hit":
                    by_seq[p["seq_id"]].prefix_cached = p["position"]
                    prefix.update(hits=1, tokens_saved=p["position"], tokens_replayed=p["replay"])
                elif rec.kind == "carry_adopted":
                    by_seq[p["seq_id"]].carry_rows = p["rows_kept"]
                    prefix.update(carry_adopted=1, carry_rows_kept=p["rows_kept"], carry_rows_appended=p["rows_to_append"])
                elif rec.kind in ("prefix_snapshotted", "carry_stored", "carry_released"):
                    prefix[rec.kind.replace("prefix_", "")] += 1
                elif rec.kind in ("request_finished", "request_cancelled"):
                    r = by_seq[p["seq_id"]]
                    r.finish_reason = p.get("reason", "cancelled")
                    r.finish_detail = p.get("detail", "")
                    r.finish_step = rec.step
                elif rec.kind == "engine_faulted":
                    kind = "fatal" if p["fatal"] else "step error"
                    faults.append(f"step {p['step']}: {kind}{' (injected)' if p['injected'] else ''}: {p['error']}")
                elif rec.kind == "invariant_violated":
                    faults.append(f"event {p['event_index']}: invariant violated in {p['machine']}: {p['message']}")
        except TraceFileError:
            raise
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # well-formed events that contradict each other
            where = "" if rec is None else f", event {rec.index} ({rec.kind})"
            raise TraceFileError(f"{reader.name}: run {run.run_id}{where} contradicts the events before it "
                                 f"({type(exc).__name__}: {exc}); `atlas replay check` says more") from None
        end = reader.end(run.run_id)
    finally:
        reader.close()
    speculation = None
    if accept.verify_steps or latched:
        # by position as vLLM counts it: accepted in the committed chain / drafted at that position (the
        # unconditional row verdicts score rows after a rejection too, against a context the chain never kept)
        chain = [round(a / n, 4) if n else 0.0 for a, n in zip(accept.conditional, accept.scored, strict=True)]
        speculation = {**accept.summary(), "latched_off": latched, "scored": list(accept.scored),
                       "accepted_by_position": list(accept.conditional), "p_by_position": chain}
    return TraceSummary(run, n, steps, dict(sorted(counts.items())), list(by_seq.values()), faults, speculation,
                        dict(prefix) if prefix else None, end)


def run_end(path_or_url: str | Path, run_id: int | None = None) -> RunEnd:
    """How a run's recording ended (the last run unless `run_id` says): replay reports a truncated run as such,
    never as a clean one."""
    reader = TraceReader(path_or_url)
    try:
        return reader.end(reader.run(run_id).run_id)
    finally:
        reader.close()
