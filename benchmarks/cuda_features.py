"""Issue 14's figures: every feature on the CUDA backend, timed through the engine.

    python benchmarks/cuda_features.py --out DIR          # the GPU: random bf16 weights from the benchmark config
    .venv/bin/python benchmarks/cuda_features.py --smoke  # atlas-tiny on the CUDA backend's CPU path (CI)

Not a test: it prints figures (and writes DIR/cuda_features.json). Measured:
- decode ms per step at batch 1, 16 and 64 with verify width K = 1 (no drafts), 3 and 5 (2 and 4 drafts), the drafts
  from a scripted oracle that knows speculation off's tokens and is right with probability 1.0, 0.7 or 0.3 per draft
  (so the cost of a verify and its commit is known whatever the random weights' own drafter would do), every step
  verifying K rows ("static"), and at 0.7 with the engine's draft-count policy ("adaptive"): tokens per step, the
  measured acceptance, and whether the tokens equal speculation off's (greedy with point-mass drafts: they must,
  bitwise in fp32; bf16's one-forward verify rounds differently from a decode, so there it is reported); then issue
  41's goals beside each figure (verify step vs decode step, tokens/s vs off);
- the stamp read (atlas.backends.cuda.stamp_read: one graph replay + one device->host copy per step): ms per
  decode step (median, like ms/step, past the graph captures) and its share of the step (goal: < 2% at batch 64);
- prefix-cache TTFT of requests sharing a system prompt (each its own question), hit against miss (prefix caching
  off), at 2,048 and 16,384 shared tokens;
- ring snapshot and restore, and prefix-snapshot store and load, per sequence (ms, device synchronised).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import zlib
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "benchmarks" / "configs" / "qwen4exp-2p7b.json"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Setup:
    """The model, backend name and options of this run (the GPU, or the smoke run's CPU path)."""

    def __init__(self, smoke: bool, config: Path) -> None:
        self.smoke = smoke
        if smoke:
            from atlas.model import load_model

            torch.set_num_threads(1)
            self.model = load_model("atlas-tiny")
            self.backend, self.options = "cuda-fp32", {"device": "cpu", "cuda_graphs": False}
        else:
            from atlas.backends.cuda.random_model import random_model

            if not torch.cuda.is_available():
                raise SystemExit("benchmarks/cuda_features.py needs an NVIDIA GPU (or --smoke)")
            self.model = random_model(json.loads(config.read_text()), device="cuda", dtype=torch.bfloat16, seed=0)
            self.backend, self.options = "cuda", {}

    def engine(self, config: Any, **kwargs: Any) -> Any:
        from atlas.engine.records import RecordingSink
        from atlas.registry import build_engine

        return build_engine(self.model.name, self.backend, config, loaded=self.model, sink=RecordingSink(),
                            backend_options=self.options, **kwargs)


def _steps(engine: Any, prompts: dict[str, list[int]], max_tokens: int,
           reads: list[float] | None = None, prefetched: list[float] | None = None
           ) -> tuple[dict[str, list[int]], list[float]]:
    """Run to the end: each request's tokens, and the wall time of every step (ms); `reads` gets every step's
    stamp-read time (ms, the store's `reads` counter: the read's wait and its Python after the sampler),
    `prefetched` the read's launch started earlier in the step (overlapping the forward; not in `reads`)."""
    from atlas.sampling.params import SamplingParams

    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    walls = []
    store = getattr(engine.backend, "store", None)
    while engine.has_unfinished():
        before = store.reads.seconds if store is not None else 0.0
        early = getattr(store.reads, "prefetch_seconds", 0.0) if store is not None else 0.0
        start = time.perf_counter()
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        _sync()
        walls.append((time.perf_counter() - start) * 1e3)
        if reads is not None and store is not None:
            reads.append((store.reads.seconds - before) * 1e3)
            if prefetched is not None:  # the read's launch started behind the forward (overlapping it)
                prefetched.append((getattr(store.reads, "prefetch_seconds", 0.0) - early) * 1e3)
    return tokens, walls


def oracle(reference: dict[str, list[int]], acceptance: float, vocab: int) -> Any:
    """Drafts speculation off's next tokens, each right with probability `acceptance` (keyed by request and
    position, so a run is deterministic), else the right token + 1."""
    from atlas.engine.drafters.scripted import ScriptedDrafter

    def script(req: Any) -> list[int]:
        ref = reference[req.request_id]
        out = []
        for i in range(req.k):
            g = req.generated + i
            right = ref[g] if g < len(ref) else 0
            lucky = zlib.crc32(f"{req.request_id}:{g}".encode()) % 1000 < acceptance * 1000
            out.append(right if lucky else (right + 1) % vocab)
        return out

    return ScriptedDrafter(script)


def bench_speculative(setup: Setup, batch: int, *, prompt_len: int, new: int, widths: tuple[int, ...] = (3, 5),
                      acceptances: tuple[float, ...] = (1.0, 0.7, 0.3)) -> list[dict[str, Any]]:
    from atlas.config import EngineConfig

    vocab = setup.model.spec.vocab_size
    g = torch.Generator().manual_seed(batch)
    prompts = {f"r{i}": torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for i in range(batch)}
    base = dict(max_seq_len=prompt_len + new + 16, max_batch_size=batch, prefill_chunk_tokens=max(4096, batch))
    rows = []
    reference: dict[str, list[int]] = {}
    # K = verify width (1 + drafts); "static": every step verifies K rows (verify_costs=(): the verify's own cost),
    # "adaptive": the engine's draft-count policy chooses 0..K-1 drafts a step from the backend's cost table
    runs = [(1, None, "-")] + [(k, a, "static") for k in widths for a in acceptances]
    runs += [(k, 0.7, "adaptive") for k in widths if 0.7 in acceptances]
    for k, acceptance, policy in runs:
        if k == 1:
            engine = setup.engine(EngineConfig(**base))
        else:
            costs = {"verify_costs": ()} if policy == "static" else {}
            engine = setup.engine(EngineConfig(**base, num_drafts=k - 1, drafter="scripted", **costs),
                                  drafter=oracle(reference, acceptance or 0.0, vocab))
        per_step: list[float] = []
        early: list[float] = []
        tokens, walls = _steps(engine, prompts, new, per_step, early)
        stats = engine.stats()
        engine.close()
        if k == 1:
            reference = tokens
        skip = 1 + min(4, len(walls) // 4)  # past the prefill step and the graph captures (the stamp read's too)
        decode = walls[skip:]
        step_ms = statistics.median(decode) if decode else float("nan")
        read_ms = statistics.median(per_step[skip:]) if per_step[skip:] else float("nan")
        generated = sum(len(t) for t in tokens.values())
        rows.append({
            "batch": batch, "K": k, "acceptance_set": acceptance, "policy": policy, "ms_per_step": step_ms,
            "steps_by_drafts": list(stats.spec_steps_by_drafts),
            "tokens_per_step": generated / max(1, len(walls) - 1),  # every decode step, the captures' too
            "tokens_per_s": generated / (sum(walls[1:]) / 1e3) if len(walls) > 1 else float("nan"),
            "acceptance_measured": (stats.spec_drafts_accepted / stats.spec_drafts_proposed
                                    if stats.spec_drafts_proposed else None),
            "tokens_equal_speculation_off": tokens == reference,
            "stamp_read_ms_per_step": read_ms,  # median over the decode steps, as ms_per_step
            # the launch of that read when it started behind the forward (a plain step): host time that overlaps
            # the device's forward, so not on the step's critical path; reported apart, never hidden
            "stamp_launch_overlapped_ms_per_step": statistics.median(early[skip:]) if early[skip:] else None,
            "stamp_read_share": read_ms / step_ms if step_ms else None,
            "stamp_read_ms_mean_incl_captures": statistics.fmean(per_step[1:]) if per_step[1:] else None,
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


# issue 41's goals on the benchmark config: a static verify of K rows against a decode step (K=3: <= 1.2x at batch
# 1, <= 1.4x at 16), and tokens/s with the 0.7 oracle against speculation off
VERIFY_GOALS = {1: 1.2, 16: 1.4}
SPEEDUP_GOALS = {(1, 3): 1.7, (1, 5): 2.0, (16, 3): 1.5, (16, 5): 1.5}


def speculation_goals(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (batch, K): the static verify's median step against the median decode step, and tokens/s at
    0.7 against speculation off, each beside its goal (never below 1.0x where none is set). A static row's tokens/s
    is the oracle's expected tokens a step (the policy's expected_tokens at 0.7 a draft) over its median step, as issue 41 states its goals: in
    bf16 a verify rounds unlike a decode, so greedy tokens part from speculation off's and the reference-keyed
    oracle's measured acceptance falls below its setting (reported in the table); an adaptive row's is its measured
    tokens a step over its median step."""
    from atlas.engine.drafters.policy import expected_tokens

    out = []
    off = {r["batch"]: r for r in rows if r["K"] == 1}
    for r in rows:
        base = off.get(r["batch"])
        if base is None or r["K"] == 1 or r["acceptance_set"] != 0.7:
            continue
        b, k = r["batch"], r["K"]
        per_seq = (r["tokens_per_step"] / b if r["policy"] != "static"
                   else expected_tokens((0.7,) * (k - 1), k - 1))
        speed = per_seq / r["ms_per_step"] * base["ms_per_step"] / (base["tokens_per_step"] / b)
        want = SPEEDUP_GOALS.get((b, k), 1.0) if r["policy"] == "static" else 1.0
        line = (f"batch {b}, K={k} ({r['policy']}): tokens/s {speed:.2f}x speculation off (goal >= {want:.1f}x: "
                f"{'met' if speed >= want else 'MISSED'})")
        if r["policy"] == "static":
            ratio = r["ms_per_step"] / base["ms_per_step"]
            goal = VERIFY_GOALS.get(b) if k == 3 else None
            line += f"; verify step {ratio:.2f}x a decode step" + (
                f" (goal <= {goal}x: {'met' if ratio <= goal else 'MISSED'})" if goal else "")
        else:
            line += f"; steps by drafts {r['steps_by_drafts']}"
        out.append(line)
    return out


def bench_prefix(setup: Setup, shared: int, turns: int = 6) -> dict[str, Any]:
    """TTFT of requests that share a `shared`-token system prompt, each with its own 16-token question, with prefix
    caching on (every request after the first hits the shared prefix) and off (each prefills it all): the median
    of the requests after the first two (the first stores the prefix; the first hit's shapes compile), one request
    at a time."""
    from atlas.config import EngineConfig

    vocab = setup.model.spec.vocab_size
    g = torch.Generator().manual_seed(shared)
    system = torch.randint(0, vocab, (shared,), generator=g).tolist()
    questions = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(turns)]
    out: dict[str, Any] = {"shared_tokens": shared}
    for prefix in (False, True):
        config = EngineConfig(max_seq_len=shared + 64, max_batch_size=1, prefill_chunk_tokens=min(shared, 4096),
                              enable_prefix_caching=prefix)
        engine = setup.engine(config)
        times = []
        for i, question in enumerate(questions):
            start = time.perf_counter()
            _steps(engine, {f"q{i}": system + question}, 1)
            times.append((time.perf_counter() - start) * 1e3)
        stats = engine.stats()
        engine.close()
        key = "hit" if prefix else "miss"
        out[f"{key}_ttft_ms"] = statistics.median(times[2:])
        out[f"{key}_ttft_runs_ms"] = times
        if prefix:
            out["hits"] = stats.prefix_cache_hits
    out["speedup"] = out["miss_ttft_ms"] / out["hit_ttft_ms"]
    print(json.dumps(out), flush=True)
    return out


def bench_snapshots(setup: Setup, prompt_len: int, repeat: int = 20) -> dict[str, Any]:
    """Ring snapshot / restore and prefix store / load of one sequence, straight on the state store."""
    from atlas.config import EngineConfig, derive_capacities
    from atlas.plan import PrefixRestore, PrefixStore, RingRestore, RingSnapshot, SeqWork, StepPlan

    config = EngineConfig(max_seq_len=prompt_len + 64, max_batch_size=2, prefill_chunk_tokens=prompt_len,
                          ring_slots=2, enable_prefix_caching=True)
    engine = setup.engine(config)
    backend, caps = engine.backend, engine.capacities
    store = backend.store
    per = caps.kv_blocks_per_seq
    prompt = tuple(torch.randint(0, setup.model.spec.vocab_size, (prompt_len,)).tolist())
    backend.execute(StepPlan(0, (SeqWork(0, prompt, 0, tuple(range(per)), True),),
                             snapshots=(RingSnapshot(0, prompt_len, 0),)))

    def timed(fn: Any) -> float:
        fn()
        _sync()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        _sync()
        return (time.perf_counter() - start) * 1e3 / repeat

    shared = tuple(range(prompt_len // caps.block_size)) + tuple(range(per, 2 * per))[prompt_len // caps.block_size:]
    out = {
        "prompt_tokens": prompt_len, "slot_bytes": backend.pools.slot_bytes(),
        "ring_snapshot_ms": timed(lambda: store.snapshot(RingSnapshot(0, prompt_len, 0))),
        "ring_restore_ms": timed(lambda: store.restore(RingRestore(0, 0, prompt_len))),
        "prefix_store_ms": timed(lambda: store.store_prefix(PrefixStore(0, prompt_len, 7, -1))),
        "prefix_load_ms": timed(lambda: store.load_prefix(PrefixRestore(1, 7, prompt_len, shared, prompt_len,
                                                                        prompt_len - 1, False))),
        "cursor_read_ms": timed(lambda: store.read_cursors([0, 1])),
        "cursor_read_reference_ms": timed(lambda: store.read_cursors_reference([0, 1])),  # the read before
    }
    assert derive_capacities(config, setup.model.spec, activation_bytes=setup.model.dtype.itemsize)
    engine.close()
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="atlas-tiny on the CPU path, small sizes")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--batches", default=None, help="comma-separated decode batches (default 1,16,64)")
    parser.add_argument("--widths", default="3,5", help="verify widths K (1 + drafts) beside K = 1 (default 3,5)")
    parser.add_argument("--acceptances", default="1.0,0.7,0.3", help="the oracle's acceptances (default 1.0,0.7,0.3)")
    parser.add_argument("--parts", default="snapshots,speculative,prefix", help="what to measure (default all)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    setup = Setup(args.smoke, args.config)
    batches = [int(b) for b in (args.batches or ("2" if args.smoke else "1,16,64")).split(",")]
    report: dict[str, Any] = {"backend": setup.backend, "model": setup.model.name,
                              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}

    def save() -> None:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "cuda_features.json").write_text(json.dumps(report, indent=2))

    if "snapshots" in parts:
        report["snapshots"] = bench_snapshots(setup, 40 if args.smoke else 2048)
        save()
    report["speculative"] = []
    for batch in batches if "speculative" in parts else ():
        report["speculative"] += bench_speculative(
            setup, batch, prompt_len=24 if args.smoke else 140, new=6 if args.smoke else 40,
            widths=tuple(int(k) for k in args.widths.split(",")),
            acceptances=tuple(float(a) for a in args.acceptances.split(",")))
        save()
    report["prefix"] = [bench_prefix(setup, shared) for shared in ((48,) if args.smoke else (2048, 16384))
                        if "prefix" in parts]
    save()
    print("| batch | K | acceptance | drafts | ms/step | tokens/step | tok/s | accepted | = spec off | stamp read ms | share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["speculative"]:
        acc = "-" if r["acceptance_measured"] is None else f"{r['acceptance_measured']:.2f}"
        print(f"| {r['batch']} | {r['K']} | {r['acceptance_set'] or '-'} | {r['policy']} | {r['ms_per_step']:.2f} | "
              f"{r['tokens_per_step']:.2f} | {r['tokens_per_s']:.0f} | {acc} | {r['tokens_equal_speculation_off']} | "
              f"{r['stamp_read_ms_per_step']:.3f} | {100 * (r['stamp_read_share'] or 0):.2f}% |")
    for line in speculation_goals(report["speculative"]):
        print(line)
    for r in report["speculative"]:
        if r["K"] == 1:
            print(f"stamp read at batch {r['batch']}, K=1: {r['stamp_read_ms_per_step']:.3f} ms of a "
                  f"{r['ms_per_step']:.2f} ms decode step = {100 * (r['stamp_read_share'] or 0):.2f}% (goal < 2%); "
                  f"its launch, overlapping the forward: {r['stamp_launch_overlapped_ms_per_step'] or 0:.3f} ms")
    for p in report["prefix"]:
        print(f"shared system prompt of {p['shared_tokens']} tokens: TTFT hit {p['hit_ttft_ms']:.1f} ms, miss "
              f"{p['miss_ttft_ms']:.1f} ms (x{p['speedup']:.1f}; {p['hits']} hits)")
    s = report.get("snapshots")
    if s is None:
        return
    print(f"per sequence ({s['slot_bytes']} state bytes): ring snapshot {s['ring_snapshot_ms']:.3f} ms, restore "
          f"{s['ring_restore_ms']:.3f} ms, prefix store {s['prefix_store_ms']:.3f} ms, load {s['prefix_load_ms']:.3f} ms, "
          f"cursor read {s['cursor_read_ms']:.3f} ms (reference read {s['cursor_read_reference_ms']:.3f} ms)")


if __name__ == "__main__":
    main()
