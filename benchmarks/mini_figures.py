"""atlas-mini's figures that depend on what the model predicts (issue 16), on held-out code, CPU backend:
MTP acceptance (p1, p2 unconditional and conditional, tokens per verify) at K = 2 and 4, the n-gram drafter's
acceptance, and the content-loop watchdog at temperature 0 (how often it fires, what the rollbacks do).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mini_figures.py                 # 48 prompts; watchdog 200
    .venv/bin/python benchmarks/mini_figures.py --smoke                           # seconds (CI)

Held-out code: this machine's standard library and site-packages files whose "<tree>/<relative path>" key falls in
the training script's held-out split (tools/mini_corpus.py: the same key hash, so files the model never saw
whatever the Python version; on the GPU machine exactly the training's held-out files). Prompts: each function
header of those files and the lines after it, cut at --prompt-tokens, taken round-robin over the files.
Every speculative run is checked to give speculation off's tokens (greedy).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

PARTS = ("mtp2", "mtp4", "ngram2", "ngram4", "watchdog")
HEADER = re.compile(r"^\s*def \w+\(.*\):\s*$")


def heldout_prompts(tok, count: int, prompt_tokens: int) -> list[list[int]]:
    import mini_corpus

    stats = mini_corpus.CorpusStats()
    _, heldout = mini_corpus.collect(mini_corpus.source_trees(), 20, 0, 3_000_000, 200_000, stats)
    per_file: list[list[list[int]]] = []
    for f in heldout:
        lines = f.text.splitlines(keepends=True)
        found = [tok.encode("".join(lines[i:i + 12]))[:prompt_tokens] for i, line in enumerate(lines)
                 if HEADER.match(line)]
        per_file.append([ids for ids in found if len(ids) >= 8])
    prompts: list[list[int]] = []
    for rank in range(max((len(p) for p in per_file), default=0)):  # round-robin: a spread over the files
        prompts += [p[rank] for p in per_file if rank < len(p)]
    return prompts[:count]


def run(model, prompts, config, max_tokens: int):
    from atlas.engine.offline import generate
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    engine = build_engine("atlas-mini", "cpu", config, loaded=model)
    t0 = time.perf_counter()
    out = generate(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    engine.close()
    return out, stats, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48, help="held-out prompts for the acceptance figures")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--watchdog-prompts", type=int, default=200)
    ap.add_argument("--watchdog-tokens", type=int, default=512, help="long enough for a loop's 256-token span")
    ap.add_argument("--watchdog-shard", default="0/1", help="I/N: this process runs the I-th of N slices of the "
                    "watchdog prompts (benchmarks/gpu_run.sh runs N in parallel)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="default: OMP_NUM_THREADS, else 1 (atlas/threads.py)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)} (one process "
                    "each runs in parallel: benchmarks/gpu_run.sh does so on the GPU machine's CPU cores)")
    ap.add_argument("--smoke", action="store_true", help="2 prompts, 6 tokens, MTP K=2 and the watchdog (CI)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in PARTS]:
        ap.error(f"--parts: {', '.join(unknown)} not of {', '.join(PARTS)}")
    if args.smoke:
        args.prompts, args.max_tokens, args.watchdog_prompts, args.watchdog_tokens = 2, 6, 2, 8

    from atlas.config import EngineConfig
    from atlas.model import load_model
    from atlas.threads import apply_threads

    apply_threads(args.threads)
    model = load_model("atlas-mini")
    prompts = heldout_prompts(model.tokenizer, max(args.prompts, args.watchdog_prompts), args.prompt_tokens)
    spec_prompts = prompts[: args.prompts]
    print(f"{len(spec_prompts)} held-out prompts of <= {args.prompt_tokens} tokens, {args.max_tokens} new tokens "
          f"each, greedy, batch {args.batch}")

    seq_len = args.prompt_tokens + max(args.max_tokens, args.watchdog_tokens) + 16
    base = dict(max_seq_len=seq_len, max_batch_size=args.batch, prefill_chunk_tokens=512)
    plain, _, plain_s = (run(model, spec_prompts, EngineConfig(**base), args.max_tokens) if parts != ["watchdog"]
                         else ([], None, 0.0))
    print(f"{'drafter':>8} {'K':>2} {'verifies':>8} {'p1':>6} {'p2_unc':>6} {'p2_cond':>7} {'tok/verify':>10} "
          f"{'seconds':>8} {'same tokens':>11}")
    print(f"{'off':>8} {0:>2} {'-':>8} {'-':>6} {'-':>6} {'-':>7} {'-':>10} {plain_s:8.1f} {'-':>11}")
    runs = [(p[:-1], int(p[-1])) for p in (["mtp2"] if args.smoke else parts) if p != "watchdog"]
    for drafter, k in runs:
        out, st, s = run(model, spec_prompts, EngineConfig(**base, num_drafts=k, drafter=drafter), args.max_tokens)
        same = sum(a.token_ids == b.token_ids for a, b in zip(out, plain, strict=True))
        unc = st.spec_acceptance_unconditional
        cond = st.spec_acceptance_conditional
        p2u = f"{unc[1]:.3f}" if len(unc) > 1 else "-"
        p2c = f"{cond[1]:.3f}" if len(cond) > 1 else "-"
        print(f"{drafter:>8} {k:>2} {st.spec_verify_steps:>8} {st.spec_acceptance_p1:6.3f} {p2u:>6} {p2c:>7} "
              f"{st.spec_tokens_per_verify:10.2f} {s:8.1f} {same:>5}/{len(out):<5}")

    if "watchdog" not in parts:
        return
    shard, shards = (int(x) for x in args.watchdog_shard.split("/"))
    wd = prompts[: args.watchdog_prompts][shard::shards]
    loose = EngineConfig(**base)
    watched = EngineConfig(**base, loop_watchdog=True, ring_slots=4)
    off, _, off_s = run(model, wd, loose, args.watchdog_tokens)
    on, st, on_s = run(model, wd, watched, args.watchdog_tokens)
    changed = sum(a.token_ids != b.token_ids for a, b in zip(on, off, strict=True))
    reasons: dict[str, int] = {}
    for g in on:
        reasons[g.finish_reason.value] = reasons.get(g.finish_reason.value, 0) + 1
    print(f"watchdog shard {shard}/{shards}: over {len(wd)} held-out prompts, temperature 0, up to {args.watchdog_tokens} tokens: "
          f"{st.rollbacks_total} rollbacks, {st.rollback_declines_total} declines; {changed} completions changed "
          f"by it; finish reasons {reasons}; mean length {sum(len(g.token_ids) for g in on) / len(on):.0f} "
          f"(off: {sum(len(g.token_ids) for g in off) / len(off):.0f}); {off_s:.0f} s off, {on_s:.0f} s on")


if __name__ == "__main__":
    main()
