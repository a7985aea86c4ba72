"""The CUDA backend's named arrangements (atlas.backends.cuda.tuning) timed side by side by `atlas bench gpu`.

Each variant's prefill and decode are measured through the engine as atlas.bench does for one arrangement; a
variant whose prefill knobs (or decode knobs) equal an already measured variant's reuses those figures instead
of spending GPU time again. Every measurement is guarded: a variant that fails (a kernel that does not compile,
a shape it refuses, an out-of-memory) is recorded with its error and the run goes on to the next one; only a
sticky CUDA fault (the context is dead) ends every later measurement, and then each says so.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from atlas.backends.cuda.tuning import Tuning

# the knobs only one kind of step reads; every other Tuning field counts for both, so a new knob is re-measured
# rather than silently shared
DECODE_ONLY: tuple[str, ...] = ()
PREFILL_ONLY = ("library_conv", "prefill_graphs")
PREFILL_KNOBS = tuple(f.name for f in attrs.fields(Tuning) if f.name not in DECODE_ONLY)
DECODE_KNOBS = tuple(f.name for f in attrs.fields(Tuning) if f.name not in PREFILL_ONLY)


def guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """fn()'s figures, or {"error": ...} if it raised (the device synchronised and its cache emptied either way)."""
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # one failing variant must not cost the others' figures
        result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}",
                  "where": traceback.format_exc(limit=-3)[-600:]}
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as exc:  # a dead context: later measurements will say so themselves
        result.setdefault("error_after", f"{type(exc).__name__}: {str(exc)[:200]}")
    result["seconds"] = time.perf_counter() - start
    return result


def _knobs(tuning: Any, names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(getattr(tuning, n) for n in names)


def measure_variants(model: Any, variants: dict[str, Any], *, batches: tuple[int, ...], prefill_tokens: int,
                     bw: float, rate: float, out: Path | None, on_variant: Callable[[str, dict], None],
                     profile: bool = True, decode_rounds: int = 1) -> dict[str, dict[str, Any]]:
    """{variant: {"tuning", "prefill", "decode_b{n}", "profile"}} with floors; figures reused where knobs agree.
    Each decode row is `decode_rounds` engines' rounds (bench_measure.decode_figures: the median and the spread).
    profile=False leaves the profiles to profile_variants (run them after every other timing: a torch.profiler
    session left the rows timed after it 10-25% slower on the H200)."""
    from atlas.bench_measure import (
        bench_decode,
        bench_prefill,
        prefill_flops,
        profile_steps,
        state_bytes,
        weight_bytes,
    )

    flops = prefill_flops(model, prefill_tokens)
    results: dict[str, dict[str, Any]] = {}
    prefill_seen: dict[tuple[str, ...], str] = {}
    decode_seen: dict[tuple[str, ...], str] = {}
    for name, tuning in variants.items():
        row: dict[str, Any] = {"tuning": attrs.asdict(tuning)}
        pk, dk = _knobs(tuning, PREFILL_KNOBS), _knobs(tuning, DECODE_KNOBS)
        if "@" in name:  # "name@2" (atlas.bench): measured again on purpose, an order control
            pk, dk = (*pk, name), (*dk, name)
        if pk in prefill_seen:
            row["prefill"] = {**results[prefill_seen[pk]]["prefill"], "same_as": prefill_seen[pk]}
        else:
            p = guarded(lambda tuning=tuning: bench_prefill(model, prefill_tokens, tuning=tuning))
            if "error" not in p:
                p.update(flops=flops, floor_ms=flops / rate * 1e3,
                         achieved_of_matmul_rate=flops / (p["ms"] / 1e3) / rate)
            row["prefill"] = p
            prefill_seen[pk] = name
        if dk in decode_seen:
            same = results[decode_seen[dk]]
            row.update({k: {**v, "same_as": decode_seen[dk]} for k, v in same.items() if k.startswith("decode_b")})
            row["profile"] = same.get("profile", {})
        else:
            for batch in batches:
                d = guarded(lambda batch=batch, tuning=tuning: bench_decode(model, batch, tuning=tuning,
                                                                            rounds=decode_rounds))
                if "error" not in d:
                    d["weight_bytes"] = weight_bytes(model, batch)
                    d["floor_ms"] = d["weight_bytes"] / bw * 1e3
                    d["floor_with_state_ms"] = (d["weight_bytes"] + state_bytes(model, batch, 180)) / bw * 1e3
                    d["over_floor"] = d["ms_per_step"] / d["floor_ms"]
                row[f"decode_b{batch}"] = d
            if profile:
                row["profile"] = guarded(lambda name=name, tuning=tuning: profile_steps(model, out, tuning,
                                                                                        f"_{name}"))
            decode_seen[dk] = name
        results[name] = row
        on_variant(name, row)
    return results


def profile_variants(model: Any, results: dict[str, dict[str, Any]], out: Path | None) -> None:
    """The profiles measure_variants(profile=False) left out, one per distinct decode arrangement, in place."""
    from atlas.backends.cuda.tuning import Tuning
    from atlas.bench_measure import profile_steps

    for name, row in results.items():
        first = next((v for k, v in row.items() if k.startswith("decode_b")), {})
        if "same_as" in first or row.get("profile"):
            continue
        tuning = Tuning(**row["tuning"])
        row["profile"] = guarded(lambda name=name, tuning=tuning: profile_steps(model, out, tuning, f"_{name}"))
    for row in results.values():
        first = next((v for k, v in row.items() if k.startswith("decode_b")), {})
        if "same_as" in first:
            row["profile"] = results[first["same_as"]].get("profile", {})


def best(results: dict[str, dict[str, Any]], key: str, metric: str) -> tuple[str, dict[str, Any]] | None:
    """The variant with the lowest `metric` under `key` (errors skipped)."""
    ok = [(n, r[key]) for n, r in results.items() if key in r and "error" not in r[key] and metric in r[key]]
    return min(ok, key=lambda nr: nr[1][metric]) if ok else None


def _cell(fig: dict[str, Any] | None, metric: str, fmt: str) -> str:
    if not fig:
        return "-"
    if "error" in fig:
        return "ERROR"
    return format(fig[metric], fmt) + (f" (={fig['same_as']})" if "same_as" in fig else "")


def variant_line(name: str, row: dict[str, Any]) -> str:
    """One table row: prefill ms and share of the matmul rate, decode ms/step and x floor per batch, kernels."""
    p = row.get("prefill", {})
    cells = [name, _cell(p, "ms", ".1f"),
             "-" if "error" in p or "achieved_of_matmul_rate" not in p else f"{100 * p['achieved_of_matmul_rate']:.1f}%"]
    for key in sorted((k for k in row if k.startswith("decode_b")), key=lambda k: int(k[8:])):
        d = row[key]
        cells.append(_cell(d, "ms_per_step", ".2f") + ("" if "error" in d else f" x{d['over_floor']:.1f}"))
    prof = row.get("profile", {})
    cells.append("/".join(str(prof.get(k, {}).get("kernels", "-")) for k in ("decode_b1", "prefill_2048"))
                 if "error" not in prof else "ERROR")
    return "| " + " | ".join(cells) + " |"


def variants_table(results: dict[str, dict[str, Any]], batches: tuple[int, ...]) -> list[str]:
    head = ["variant", "prefill 2048 ms", "of matmul rate", *(f"decode b{b} ms (x floor)" for b in batches),
            "kernels b1/prefill"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [variant_line(n, r) for n, r in results.items()]
    for name, row in results.items():
        for key, fig in row.items():
            if isinstance(fig, dict) and "error" in fig and "same_as" not in fig:
                lines.append(f"ERROR {name} {key}: {fig['error']}")
    return lines
