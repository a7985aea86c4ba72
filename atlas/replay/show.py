"""`atlas trace show`: a TraceSummary rendered for a reader (rich tables on stdout).

Text that comes from the trace (model names, fingerprints, details, fault messages) is printed with rich markup
off: a fingerprint such as `[dbe7...]` or a detail with brackets would otherwise be read as a markup tag and
vanish.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from atlas.replay.summary import TraceSummary


def _value(v: Any) -> str:
    return json.dumps(v) if isinstance(v, dict | list) or v is None else str(v)


def config_table(config: dict[str, Any]) -> Table:
    table = Table("config", "value", title=None)
    for key in sorted(config):
        table.add_row(Text(key), Text(_value(config[key])))
    return table


def speculation_table(sp: dict[str, Any]) -> Table:
    """Per draft position: drafted, accepted in the committed chain (vLLM's per-position count), its rate, the
    rate given every earlier draft was accepted, and the row's own agreement whatever came before (a row after
    a rejection is scored against a context the chain never kept: not an acceptance)."""
    table = Table("position", "drafted", "accepted", "rate", "rate given 1..k-1 accepted",
                  "row agreement (ignores earlier rejections)")
    for k, (n, a, p, c, u) in enumerate(zip(sp["scored"], sp["accepted_by_position"], sp["p_by_position"],
                                            sp["p_conditional"], sp["p_unconditional"], strict=True), start=1):
        table.add_row(str(k), str(n), str(a), f"{p:.4f}", f"{c:.4f}", f"{u:.4f}")
    return table


def render(s: TraceSummary, console: Console) -> None:
    r = s.run
    say = lambda text: console.print(text, markup=False, highlight=False)  # noqa: E731
    say(f"run {r.run_id}: atlas {r.engine_version} (git {r.git_revision or '?'}), model {r.model} "
        f"[{r.model_fingerprint[:16]}], backend {r.backend}")
    say(f"{s.events} events over {s.steps} steps; outcomes: "
        + (", ".join(f"{k} {v}" for k, v in s.outcome_counts.items()) or "no requests"))
    if s.end is not None and s.end.truncated:  # a killed run: say so before anything that looks complete
        console.print(s.end.describe(), style="bold red", markup=False, highlight=False)
    console.print(config_table(r.config))
    for fault in s.faults:
        console.print(fault, markup=False, highlight=False, style="red")
    if s.speculation:
        sp = s.speculation
        say(f"speculation: {sp['verify_steps']} verifies, {sp['tokens_per_verify']} tokens per verify, "
            f"{sp['drafts_accepted']}/{sp['drafts_proposed']} drafts accepted, p1 {sp['p1']}, "
            f"latched off {sp['latched_off']}")
        if sp["scored"]:
            console.print(speculation_table(sp))
    if s.prefix:
        px = s.prefix
        say(f"prefix cache: {px.get('hits', 0)} hits, {px.get('tokens_saved', 0)} prefill tokens saved "
            f"({px.get('tokens_replayed', 0)} replayed), {px.get('snapshotted', 0)} snapshots; drafter carry: "
            f"{px.get('carry_stored', 0)} stored, {px.get('carry_adopted', 0)} adopted "
            f"({px.get('carry_rows_kept', 0)} rows kept, {px.get('carry_rows_appended', 0)} appended), "
            f"{px.get('carry_released', 0)} released")
        for q in s.requests:
            if q.prefix_cached:
                say(f"  {q.request_id}: resumed at {q.prefix_cached} of {q.prompt_tokens} prompt tokens, "
                    f"{q.carry_rows} drafter rows carried")
    table = Table("request", "seq", "prompt", "completion", "arrived", "finished", "preempted", "finish", "detail")
    for q in s.requests:
        table.add_row(Text(q.request_id), str(q.seq_id), str(q.prompt_tokens), str(q.completion_tokens),
                      str(q.arrival_step), "-" if q.finish_step is None else str(q.finish_step), str(q.preemptions),
                      q.finish_reason or "unfinished", Text(q.finish_detail or ""))
    console.print(table)
    counts = Table("event kind", "count")
    for kind, n in s.event_counts.items():
        counts.add_row(kind, str(n))
    console.print(counts)
