"""atlas-mini's time per output token with MTP speculation vs without, at batch 1 and 16 on held-out code, one row
per (batch, drafts) beside its goal (issue 41):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mini_tpot.py --backend cpu --batches 1,16 --drafts 2,4
    python3 benchmarks/mini_tpot.py                      # CUDA (bf16)
    .venv/bin/python benchmarks/mini_tpot.py --smoke     # the CPU backend, 6 tokens (CI: the script runs)

TPOT: the wall time of the decode phase over the tokens it produced (prefill excluded: each batch's prompts are
prefilled first, untimed). Rounds alternate speculation off and each draft count (a shared machine's load falls
on all alike); the median of --repeats rounds. Speculation runs with the engine's draft-count policy (drafts is
the upper bound, `atlas serve --num-drafts`); `--static` verifies every draft every step. Greedy; every
speculative run's tokens are compared with speculation off's (bitwise on the CPU reference; on bf16 CUDA a K-row
verify rounds unlike a 1-row decode, so the count of identical completions is printed, not asserted).
Goals: TPOT <= 0.65x off at batch 1 with 2 drafts on the CPU (0.6x on CUDA), never above 1.0x elsewhere.
"""

from __future__ import annotations

import argparse
import statistics
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


def goal(backend: str, batch: int, drafts: int) -> float:
    if batch == 1 and drafts == 2:
        return 0.65 if backend == "cpu" else 0.6
    return 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--drafts", default="2,4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--static", action="store_true", help="no draft-count policy: every step verifies --drafts")
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
    draft_counts = [int(k) for k in args.drafts.split(",")]
    prompts = heldout_prompts(model.tokenizer, max(batches), args.prompt_tokens)
    print(f"atlas-mini on {args.backend}: {args.max_tokens} tokens after <= {args.prompt_tokens}-token held-out "
          f"prompts, greedy, MTP drafter, {'static drafts' if args.static else 'draft-count policy on'}; TPOT = decode "
          f"wall / tokens per sequence, median of {args.repeats} alternating rounds")
    print(f"{'batch':>5} {'drafts':>6} {'TPOT ms':>8} {'off ms':>7} {'p1':>6} {'tok/verify':>10} {'steps by k':>14} "
          f"{'vs off':>7} {'goal':>6} {'met':>4} {'same as off':>11}")
    for b in batches:
        group = prompts[:b]
        seq_len = args.prompt_tokens + args.max_tokens + 16
        base = dict(max_seq_len=seq_len, max_batch_size=b, prefill_chunk_tokens=max(512, b * args.prompt_tokens))
        configs = {0: EngineConfig(**base)}
        for k in draft_counts:
            configs[k] = EngineConfig(**base, num_drafts=k, drafter="mtp", **({"verify_costs": ()} if args.static else {}))
        tpots: dict[int, list[float]] = {k: [] for k in configs}
        last: dict[int, tuple] = {}
        for _ in range(args.repeats):  # alternate: off, then each draft count, every round
            for k, config in configs.items():
                tpot, tokens, st = decode_tpot(model, args.backend, group, config, args.max_tokens)
                tpots[k].append(tpot)
                last[k] = (tokens, st)
        off = statistics.median(tpots[0])
        ref_tokens = last[0][0]
        for k in draft_counts:
            tpot = statistics.median(tpots[k])
            tokens, st = last[k]
            same = sum(a == r for a, r in zip(tokens, ref_tokens, strict=True))
            ratio, want = tpot / off, goal(args.backend, b, k)
            by_k = "/".join(str(n) for n in st.spec_steps_by_drafts) or "-"
            print(f"{b:>5} {k:>6} {1e3 * tpot:8.3f} {1e3 * off:7.3f} {st.spec_acceptance_p1:6.3f} "
                  f"{st.spec_tokens_per_verify:10.2f} {by_k:>14} {ratio:6.2f}x {want:5.2f}x {'yes' if ratio <= want else 'NO':>4} "
                  f"{same:>5}/{len(tokens):<5}")


if __name__ == "__main__":
    main()
