"""atlas-mini's time per output token with the MTP drafter vs without, and with the drafter's prompt context on vs
off (the PR #352 comparison: ATLAS_NO_MTP_DRAFTER_CONTEXT=1 is `drafter_context=False`), at batch 1 and 16 on
held-out code (issue 16).

    python3 benchmarks/mini_tpot.py                      # CUDA (bf16), batch 1 and 16, K = 2 and 4
    .venv/bin/python benchmarks/mini_tpot.py --smoke     # the CPU backend, 6 tokens (CI: the script runs)

TPOT: the wall time of the decode phase over the tokens it produced (prefill excluded: each batch's prompts are
prefilled first, untimed), best of --repeats. Greedy; every speculative run's tokens are compared with
speculation off's (bitwise on the CPU reference; on bf16 CUDA a K-row verify rounds unlike a 1-row decode, so the
count of identical completions is printed, not asserted).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def decode_tpot(model, backend: str, prompts, config, max_tokens: int) -> tuple[float, list, object]:
    from atlas.registry import build_engine
    from atlas.sampling.params import SamplingParams

    engine = build_engine("atlas-mini", backend, config, loaded=model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        tokens[f"r{i}"] = []
    while any(seq.cursor.computed < seq.cursor.prompt_len for seq in engine.state.seqs.values()) or \
            engine.book.pending:  # prefill, untimed (the first token comes with it)
        for o in engine.step():
            tokens[o.request_id] += list(o.new_token_ids)
    first = sum(len(t) for t in tokens.values())
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += list(o.new_token_ids)
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    engine.close()
    produced = sum(len(t) for t in tokens.values()) - first
    return seconds / max(1, produced) * len(prompts), [tokens[f"r{i}"] for i in range(len(prompts))], stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--drafts", default="2,4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="CPU backend, batch 1, K=2, 6 tokens")
    args = ap.parse_args()
    if args.smoke:
        args.backend, args.batches, args.drafts, args.max_tokens, args.repeats = "cpu", "1", "2", 6, 1

    from mini_figures import heldout_prompts

    from atlas.config import EngineConfig
    from atlas.model import load_model
    from atlas.threads import apply_threads

    apply_threads(None)
    model = load_model("atlas-mini")
    batches = [int(b) for b in args.batches.split(",")]
    prompts = heldout_prompts(model.tokenizer, max(batches), args.prompt_tokens)
    print(f"atlas-mini on {args.backend}: {args.max_tokens} tokens after <= {args.prompt_tokens}-token held-out "
          f"prompts, greedy, TPOT = decode wall / tokens per sequence, best of {args.repeats}")
    print(f"{'batch':>5} {'drafter':>16} {'K':>2} {'TPOT ms':>8} {'vs off':>7} {'p1':>6} {'p2_unc':>6} "
          f"{'tok/verify':>10} {'same as off':>11}")
    for b in batches:
        group = prompts[:b]
        seq_len = args.prompt_tokens + args.max_tokens + 16
        base = dict(max_seq_len=seq_len, max_batch_size=b, prefill_chunk_tokens=max(512, b * args.prompt_tokens))
        runs = [("off", 0, True)] + [(f"mtp ctx {'on' if ctx else 'off'}", k, ctx)
                                      for k in (int(x) for x in args.drafts.split(",")) for ctx in (True, False)]
        ref_tpot, ref_tokens = None, None
        for name, k, ctx in runs:
            config = EngineConfig(**base, num_drafts=k, drafter="mtp", drafter_context=ctx)
            best, tokens, st = float("inf"), None, None
            for _ in range(args.repeats):
                tpot, tokens, st = decode_tpot(model, args.backend, group, config, args.max_tokens)
                best = min(best, tpot)
            if ref_tpot is None:
                ref_tpot, ref_tokens = best, tokens
                print(f"{b:>5} {name:>16} {k:>2} {1e3 * best:8.3f} {'-':>7} {'-':>6} {'-':>6} {'-':>10} {'-':>11}")
                continue
            same = sum(a == r for a, r in zip(tokens, ref_tokens, strict=True))
            unc = st.spec_acceptance_unconditional
            p2 = f"{unc[1]:.3f}" if len(unc) > 1 else "-"
            print(f"{b:>5} {name:>16} {k:>2} {1e3 * best:8.3f} {best / ref_tpot - 1:+7.1%} {st.spec_acceptance_p1:6.3f} "
                  f"{p2:>6} {st.spec_tokens_per_verify:10.2f} {same:>5}/{len(tokens):<5}")


if __name__ == "__main__":
    main()
