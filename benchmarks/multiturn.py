"""Multi-turn chat on the CPU backend with atlas-tiny: prefix caching and the MTP drafter carry, on vs off.

    .venv/bin/python benchmarks/multiturn.py [--sessions 2] [--turns 4] [--system 160] [--user 24] [--answer 16]
                                             [--drop 2] [--out results.json] [--smoke]

Each session starts with a `--system`-token prompt; every later turn's prompt is the previous prompt + the
previous answer with its last `--drop` tokens re-tokenised (replaced, as a chat template does at the
assistant/user boundary) + `--user` new tokens. Two layouts: "sequential" (a session's turns back to back,
A1 A2 A3 B1 B2 B3) and "interleaved" (A1 B1 A2 B2 ...). The carry is ONE entry (the last finished turn's), so
in the interleaved layout a warm turn finds the other session's carry: it is released and the drafter starts
at the resume position (the target's prefix cache hits either way). Both legs run greedy with MTP
speculation (2 drafts) and must produce the same tokens.

Reported, for warm turns (every turn after a session's first):
- drafter coverage: drafter rows / prompt length when the prefill completes (the issue asks >= 95%);
- prefill tokens saved: tokens the prefix cache resumed past / warm prompt tokens;
- time to first token, median over warm turns, prefix caching on vs off (the exact CPU path feeds one token at a
  time, so TTFT is roughly proportional to the tokens fed).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from atlas.config import EngineConfig
from atlas.model import load_model
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams


def session_prompts(rng: random.Random, system: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(system)]


def run_leg(loaded, prefix: bool, args: argparse.Namespace, layout: str) -> dict:
    config = EngineConfig(max_seq_len=args.max_seq_len, max_batch_size=2, prefill_chunk_tokens=256, block_size=16,
                          enable_prefix_caching=prefix, num_drafts=2, drafter="mtp")
    engine = build_engine("atlas-tiny", "cpu", config, loaded=loaded)
    rng = random.Random(1234)
    prompts = [session_prompts(rng, args.system) for _ in range(args.sessions)]
    order = ([(s, t) for t in range(args.turns) for s in range(args.sessions)] if layout == "interleaved"
             else [(s, t) for s in range(args.sessions) for t in range(args.turns)])
    warm_ttft, cold_ttft, answers = [], [], []
    warm_prompt_tokens = 0
    for n, (s, t) in enumerate(order):
        prompt = prompts[s]
        rid = f"s{s}t{t}"
        start = time.perf_counter()
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=args.answer), stream=True)
        first = None
        out: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                if o.new_token_ids and first is None:
                    first = time.perf_counter() - start
                out.extend(o.new_token_ids)
        (warm_ttft if t else cold_ttft).append(first)
        if t:
            warm_prompt_tokens += len(prompt)
        answers.append(out)
        kept = out[: max(0, len(out) - args.drop)] + [rng.randrange(3, 250) for _ in range(min(args.drop, len(out)))]
        prompts[s] = prompt + kept + [rng.randrange(3, 250) for _ in range(args.user)]
        del n
    stats = engine.stats()
    return {
        "prefix_caching": prefix,
        "drafter_context": engine.config.drafter_context,
        "layout": layout,
        "warm_turns": len(warm_ttft),
        "warm_ttft_median_s": statistics.median(warm_ttft),
        "cold_ttft_median_s": statistics.median(cold_ttft),
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "prefill_tokens_saved": stats.prefix_tokens_saved,
        "prefill_tokens_replayed": stats.prefix_tokens_replayed,
        "warm_prompt_tokens": warm_prompt_tokens,
        "saved_fraction": stats.prefix_tokens_saved / warm_prompt_tokens if warm_prompt_tokens else 0.0,
        "drafter_coverage_warm": stats.drafter_coverage_warm,
        "drafter_coverage_cold": stats.drafter_coverage_cold,
        "carry_adopted": stats.carry_adopted_total,
        "tokens_per_verify": stats.spec_tokens_per_verify,
        "answers": answers,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=160)
    p.add_argument("--user", type=int, default=24)
    p.add_argument("--answer", type=int, default=16)
    p.add_argument("--drop", type=int, default=2, help="answer tokens re-tokenised at each boundary")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="default: OMP_NUM_THREADS, else 1 (atlas/threads.py)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="2 sessions of 2 short turns: seconds, for CI")
    args = p.parse_args()
    if args.smoke:
        args.turns, args.system, args.user, args.answer = 2, 32, 8, 4
    from atlas.threads import apply_threads

    apply_threads(args.threads)
    loaded = load_model("atlas-tiny")
    results = []
    for layout in ("sequential", "interleaved"):
        on = run_leg(loaded, True, args, layout)
        off = run_leg(loaded, False, args, layout)
        if on["answers"] != off["answers"]:
            raise SystemExit(f"{layout}: prefix caching changed the tokens")
        for leg in (on, off):
            leg.pop("answers")
        results += [on, off]
        print(f"{layout}: {on['warm_turns']} warm turns, tokens equal on/off")
        context = "on" if on["drafter_context"] else "off (ATLAS_NO_MTP_DRAFTER_CONTEXT=1)"
        print(f"  drafter context {context}; coverage on warm turns: {on['drafter_coverage_warm']:.1%} (cold turns "
              f"{on['drafter_coverage_cold']:.1%}; with prefix caching off every turn is cold); carry adopted "
              f"{on['carry_adopted']}x")
        print(f"  prefill tokens saved: {on['prefill_tokens_saved']} of {on['warm_prompt_tokens']} warm prompt tokens "
              f"({on['saved_fraction']:.1%}), {on['prefill_tokens_replayed']} replayed; hits {on['prefix_cache_hits']}"
              f"/{on['prefix_cache_queries']}")
        print(f"  warm-turn TTFT median: {on['warm_ttft_median_s'] * 1e3:.0f} ms with prefix caching, "
              f"{off['warm_ttft_median_s'] * 1e3:.0f} ms without ({off['warm_ttft_median_s'] / on['warm_ttft_median_s']:.1f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
