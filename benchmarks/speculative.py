"""Speculative decoding on the CPU backend: tokens per verify step and wall-clock speed-up vs speculation off.

    .venv/bin/python benchmarks/speculative.py                      # atlas-tiny, 3 drafts, 96 new tokens
    .venv/bin/python benchmarks/speculative.py --num-drafts 2 --max-tokens 64 --threads 2
    .venv/bin/python benchmarks/speculative.py --smoke              # 8 new tokens, one repeat (CI)

Not a test: it prints figures. Every speculative run is checked to give speculation off's tokens (greedy).
Drafters: n-gram prompt lookup on a repetitive prompt, the MTP head, and a scripted oracle that always
drafts the right tokens (the ceiling of the mechanics: K tokens per verify). atlas-tiny is a random model,
so its MTP head agrees with it rarely; expect low MTP acceptance there. The CPU reference feeds verify rows
one at a time (that is what makes its commits exact), so a verify of K rows costs about K decodes: on this
backend the wall clock gains only what the per-step overheads save, whatever the tokens per verify.
"""

from __future__ import annotations

import argparse
import time

REPETITIVE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
              "def mul(a, b):\n    return a * b\n\ndef div(a, b):\n    return a / b\n\ndef ")
NATURAL = "The committee met on Tuesday to discuss the budget for next year, and after a long debate"


def run(model, prompt: list[int], max_tokens: int, num_drafts: int, drafter, repeats: int):
    from atlas.config import EngineConfig
    from atlas.engine.offline import generate
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    kind = drafter if isinstance(drafter, str) else "scripted"
    config = EngineConfig(max_seq_len=len(prompt) + max_tokens + 8, max_batch_size=1,
                          prefill_chunk_tokens=len(prompt) + 8, num_drafts=num_drafts, drafter=kind)
    best, tokens, stats = float("inf"), None, None
    for _ in range(repeats):
        engine = build_engine("atlas-tiny", "cpu", config, loaded=model,
                                    **({} if isinstance(drafter, str) else {"drafter": drafter}))
        t0 = time.perf_counter()
        (r,) = generate(engine, [prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        best = min(best, time.perf_counter() - t0)
        tokens, stats = r.token_ids, engine.stats()
    return best, tokens, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-drafts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="default: OMP_NUM_THREADS, else 1 (atlas/threads.py)")
    ap.add_argument("--smoke", action="store_true", help="8 new tokens, one repeat: seconds, for CI")
    args = ap.parse_args()
    if args.smoke:
        args.max_tokens, args.repeats = 8, 1
    from atlas.threads import apply_threads

    args.threads = apply_threads(args.threads)

    import structlog

    from atlas.engine.drafters import ScriptedDrafter
    from atlas.model import load_model

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # quiet: figures only
    model = load_model("atlas-tiny")
    print(f"atlas-tiny on the CPU backend, {args.threads} thread(s), greedy, {args.max_tokens} new tokens, "
          f"K = {args.num_drafts + 1}")
    print(f"{'prompt':<11} {'drafter':<8} {'verifies':>8} {'tok/verify':>10} {'p1':>6} {'p_uncond by pos':<22} "
          f"{'off s':>7} {'on s':>7} {'speed-up':>8}")
    for name, text in (("repetitive", REPETITIVE), ("natural", NATURAL)):
        prompt = model.tokenizer.encode(text)[: 40 if args.smoke else None]  # smoke: the prefill is token by token
        off_s, reference, _ = run(model, prompt, args.max_tokens, 0, "ngram", args.repeats)

        def oracle(req, reference=reference):  # the reference's next tokens: every draft is right
            return reference[req.generated : req.generated + req.k]

        for drafter in ("ngram", "mtp", ScriptedDrafter(oracle)):
            on_s, tokens, stats = run(model, prompt, args.max_tokens, args.num_drafts, drafter, args.repeats)
            if tokens != reference:
                raise SystemExit(f"{name}/{drafter}: speculation changed the tokens")
            label = drafter if isinstance(drafter, str) else "oracle"
            unc = ", ".join(f"{p:.2f}" for p in stats.spec_acceptance_unconditional)
            print(f"{name:<11} {label:<8} {stats.spec_verify_steps:>8} {stats.spec_tokens_per_verify:>10.2f} "
                  f"{stats.spec_acceptance_p1:>6.2f} {unc:<22} {off_s:>7.3f} {on_s:>7.3f} {off_s / on_s:>7.2f}x")


if __name__ == "__main__":
    main()
