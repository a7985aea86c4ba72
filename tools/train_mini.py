#!/usr/bin/env python3
"""Train atlas-mini end to end: corpus -> tokenizer -> qwen4_exp model + MTP head -> eval -> checkpoint.

    python tools/train_mini.py --out OUT                      # the GPU run (tools/train_gpu.sh wraps it)
    python tools/train_mini.py --device cpu --tiny --out OUT  # the CPU smoke test: the whole pipeline, < 2 min

Training uses transformers' Qwen4ExpForCausalLM (the pinned 5.24.0) with three of its code paths replaced by
equivalent fast ones (tools/train_patches.py), torch AdamW, bf16 autocast on CUDA. The QSA indexer, which the
LM loss cannot reach, learns by distillation from its layer's attention (tools/indexer_loss.py). The MTP head
(tools/mini_mtp.py) trains jointly, on the trunk's DETACHED hidden states and the detached shared
embedding / lm_head: the trunk trains exactly as it would without it (its loss is untouched), while the head
learns on the same batches, with no second pass over the trunk, what a head trained on the frozen trunk
afterwards would learn; the cosine schedule's low-lr tail lets it settle on the final trunk. Its loss mixes the
text's t_{k+2} with the trunk's own distribution at k + 1 (`--mtp-soft`), since a greedy verify accepts a
draft when it equals the trunk's argmax, not the text.

The training budget is wall clock (`--minutes`): after a few timed steps the step count is fixed, and the
schedule runs over it; `--steps N` fixes it instead (the metrics record the count, so a rerun can pin it).
Outputs in --out (8 files): config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
README.md (the model card), metrics.json, heldout_sample.json (what the CPU tests evaluate), train.log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import indexer_loss
import mini_card
import mini_corpus
import mini_eval
import numpy as np
import torch
import torch.nn.functional as F
import train_patches
from mini_config import EOS_ID, IM_END_ID, SPECIAL_TOKENS, model_config
from mini_mtp import build_models, mtp_loss, mtp_pairs

# per mode: what the GPU run uses, and the CPU smoke test's (tiny preset, small corpus, a few steps)
DEFAULTS = {
    "mini": dict(batch=64, seq_len=512, lr=3e-3, warmup=100, vocab=4096, max_train_mb=160.0, max_heldout_mb=3.0,
                 tokenizer_mb=8.0, eval_tokens=1_000_000, log_every=50, eval_batch=32, completion_tokens=96),
    "tiny": dict(batch=8, seq_len=128, lr=3e-3, warmup=10, vocab=1024, max_train_mb=1.5, max_heldout_mb=0.25,
                 tokenizer_mb=0.5, eval_tokens=8192, log_every=5, eval_batch=8, completion_tokens=24),
}
CALIBRATION = (3, 11)  # steps [3, 11) are timed to fix the step count (the first ones carry one-off setup)
# what tests/test_atlas_mini.py allows between this run's fp32 figures and Atlas's CPU backend on the same
# saved weights. Measured CPU run -> Atlas CPU: loss 5.6500 vs 5.6501, MTP p1 equal (logits within 2e-6); a GPU
# run's fp32 differs from the CPU's in the last bits, which can flip an argmax near-tie (1 of ~1,000 rows: 0.001)
SAMPLE_LOSS_MARGIN = 0.01
SAMPLE_MTP_P1_MARGIN = 0.02


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny preset and corpus: the CPU smoke test")
    p.add_argument("--minutes", type=float, default=5.0, help="training wall-clock budget (default 5)")
    p.add_argument("--steps", type=int, default=0, help="fixed step count instead of --minutes")
    p.add_argument("--total-minutes", type=float, default=0.0,
                   help="cap on the whole run: training gets at most this minus setup and a 60 s reserve for eval")
    p.add_argument("--seed", type=int, default=1234)
    for name in DEFAULTS["mini"]:
        p.add_argument("--" + name.replace("_", "-"), type=type(DEFAULTS["mini"][name]), default=None)
    p.add_argument("--heldout-permille", type=int, default=20, help="files held out, per mille (by path hash)")
    p.add_argument("--max-file-kb", type=int, default=200)
    p.add_argument("--sample-tokens", type=int, default=1024, help="tokens of held-out files kept for the tests")
    p.add_argument("--mtp-soft", type=float, default=0.5, help="weight of the trunk's distribution in the MTP loss")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--indexer-loss", type=float, default=1.0,
                   help="weight of the QSA indexer's distillation loss (tools/indexer_loss.py; 0: untrained indexer)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (default: on for cuda; --bf16 on the CPU tries the GPU's dtype paths)")
    p.add_argument("--compile", action="store_true", help="torch.compile the trunk (off: not tried on the GPU)")
    p.add_argument("--no-patches", action="store_true", help="transformers' own slow paths (to measure them)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    for name, value in DEFAULTS["tiny" if args.tiny else "mini"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.bf16 is None:
        args.bf16 = args.device.startswith("cuda")
    return args


class Log:
    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def sync(device: torch.device) -> None:
    if device.type == "cuda":  # CUDA-only: timings need the queue drained
        torch.cuda.synchronize()


def windows(stream: np.ndarray, seq_len: int, batch: int, seed: int):
    """Endless (epoch, batch [B, T]) over non-overlapping windows, reshuffled each epoch from the seed."""
    n = len(stream) // seq_len
    if n < batch:
        raise ValueError(f"the train stream ({len(stream)} tokens) holds {n} windows of {seq_len}; --batch is {batch}")
    data = torch.from_numpy(stream[: n * seq_len].astype(np.int64)).view(n, seq_len)
    epoch = 0
    while True:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1009 + epoch))
        for i in range(0, n - batch + 1, batch):
            yield epoch, data[order[i : i + batch]]
        epoch += 1


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def param_groups(modules, weight_decay: float) -> list[dict]:
    decay, plain = [], []
    for module in modules:
        for name, p in module.named_parameters():
            (decay if p.dim() >= 2 and "embed" not in name else plain).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def step_losses(model, trunk, head, x: torch.Tensor, mtp_soft: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch's (LM loss, router balance loss, MTP loss, indexer loss): the MTP head and the indexer loss see
    the trunk only detached (the indexer loss is 0 unless tools/indexer_loss.py is applied)."""
    cfg = model.config
    out = trunk(input_ids=x, use_cache=False, output_router_logits=True)
    logits = model.lm_head(out.last_hidden_state)
    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), x[:, 1:].flatten())
    aux = train_patches.router_balance_loss(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
    embed, pair_hidden = mtp_pairs(model.model.embed_tokens.weight.detach(), out.last_hidden_state.detach(), x)
    drafts = F.linear(head(embed, pair_hidden), model.lm_head.weight.detach())
    return loss, aux, mtp_loss(drafts, logits, x, mtp_soft), indexer_loss.collect(x.device)


EVAL_RESERVE_S = 60.0  # eval + save of the mini preset: ~30 s expected on the GPU


def train(args, model, head, stream: np.ndarray, device: torch.device, log: Log) -> dict:
    aux_coef = model.config.router_aux_loss_coef
    trunk_params, head_params = list(model.parameters()), list(head.parameters())
    opt = torch.optim.AdamW(param_groups([model, head], args.weight_decay), lr=args.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    trunk = torch.compile(model.model) if args.compile else model.model
    budget = args.minutes * 60
    if args.total_minutes:
        left = args.total_minutes * 60 - (time.perf_counter() - log.t0) - EVAL_RESERVE_S
        if left < budget:
            log(f"training budget cut from {budget:.0f} s to {left:.0f} s: setup took "
                f"{time.perf_counter() - log.t0:.0f} s of --total-minutes {args.total_minutes:g}")
            budget = max(left, 30.0)
    total = args.steps or 10**9  # until calibrated
    warmup = args.warmup
    curve: list[dict] = []
    batches = windows(stream, args.seq_len, args.batch, args.seed)
    model.train()
    head.train()
    start = time.perf_counter()
    step = epoch = 0
    stopped = None
    # losses summed on the device between log points (no host sync per step); the curve holds interval means
    sums = torch.zeros(4, device=device)
    since = 0
    while step < total:
        epoch, x = next(batches)
        x = x.to(device, non_blocking=True)
        lr = lr_at(step, total, warmup, args.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast:
            loss, aux, m_loss, i_loss = step_losses(model, trunk, head, x, args.mtp_soft)
        (loss + aux_coef * aux + m_loss + args.indexer_loss * i_loss).backward()
        # clipped apart, so the head's gradients never scale the trunk's
        torch.nn.utils.clip_grad_norm_(trunk_params, 1.0)
        torch.nn.utils.clip_grad_norm_(head_params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sums += torch.stack([loss.detach(), m_loss.detach(), aux.detach(), i_loss.detach()]).float()
        since += 1
        step += 1
        if not args.steps and step in CALIBRATION:
            sync(device)
            if step == CALIBRATION[0]:
                mark = time.perf_counter()
            else:
                step_s = (time.perf_counter() - mark) / (CALIBRATION[1] - CALIBRATION[0])
                total = max(step + 1, step + int((budget - (time.perf_counter() - start)) / step_s))
                # a slow machine gets a proportionate warm-up (at most a tenth of the run), not a fixed 100 steps
                warmup = min(warmup, max(CALIBRATION[1], total // 10))
                log(f"calibrated: {step_s * 1000:.1f} ms/step ({args.batch * args.seq_len / step_s:,.0f} tokens/s) "
                    f"-> {total} steps in {budget:.0f} s")
        if step % args.log_every == 0 or step == total or step == 1:
            elapsed = time.perf_counter() - start
            means = (sums / since).tolist()
            sums.zero_()
            since = 0
            point = {"step": step, "tokens": step * args.batch * args.seq_len, "elapsed_s": round(elapsed, 2),
                     "lr": lr, "loss": means[0], "mtp_loss": means[1], "aux": means[2], "indexer_loss": means[3],
                     "epoch": epoch}
            curve.append(point)
            planned = total if total < 10**9 else "?"
            log(f"step {step}/{planned} loss {point['loss']:.4f} mtp {point['mtp_loss']:.4f} aux {point['aux']:.3f} "
                f"indexer {point['indexer_loss']:.3f} "
                f"lr {lr:.2e} {point['tokens'] / max(elapsed, 1e-9):,.0f} tok/s epoch {epoch}")
            if not args.steps and elapsed > 1.15 * budget + 10:
                stopped = f"wall clock: {elapsed:.0f} s > 1.15 x the {budget:.0f} s budget at step {step}"
                log("stopping early, " + stopped)
                break
    sync(device)
    train_s = time.perf_counter() - start
    tokens = step * args.batch * args.seq_len
    return {"steps": step, "planned_steps": total, "warmup_steps": warmup, "budget_s": budget, "tokens": tokens,
            "train_s": train_s, "tokens_per_s": tokens / train_s, "epochs": tokens / len(stream),
            "stopped_early": stopped, "curve": curve}


def round_to_bf16(*modules) -> None:
    """Evaluate exactly the weights that are saved (model.safetensors is bf16)."""
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.copy_(p.to(torch.bfloat16).float())


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, {os.cpu_count()} CPU cores"
    return f"CPU ({platform.machine()}), {torch.get_num_threads()} torch threads of {os.cpu_count()} cores"


def evaluate(args, model, head, tok, heldout, heldout_stream: np.ndarray, device: torch.device, log: Log) -> dict:
    """Every figure of the card, in fp32 on the saved (bf16-rounded) weights: held-out loss, the test sample,
    greedy completions, and the bounds tests/test_atlas_mini.py holds Atlas's CPU backend to."""
    torch.set_float32_matmul_precision("highest")
    model.eval()
    head.eval()
    figures = mini_eval.heldout_figures(model, head, heldout_stream, args.seq_len, args.eval_batch,
                                        args.eval_tokens, device)
    log(f"held out: loss {figures['loss']:.4f} ppl {figures['perplexity']:.2f} top1 {figures['top1']:.3f} "
        f"MTP p1 {figures['mtp_p1']:.3f} (draft = text {figures['mtp_top1_text']:.3f}) over {figures['tokens']:,}")
    sample = mini_eval.sample_files(heldout, args.sample_tokens, tok)
    sample_figs = mini_eval.sample_figures(model, head, tok, sample, device)
    log(f"test sample: {len(sample)} files, {sample_figs['tokens']} tokens, loss {sample_figs['loss']:.4f}, "
        f"MTP p1 {sample_figs['mtp_p1']:.3f}")
    completions = []
    for prompt in mini_eval.completion_prompts(heldout, 4):
        text = mini_eval.greedy(model, tok, prompt, args.completion_tokens, (EOS_ID, IM_END_ID), device)
        completions.append({"prompt": prompt, "completion": text})
        log(f"completion {prompt!r} -> {text!r}")
    return {
        "heldout": figures,
        "sample": sample_figs,
        "sample_files": sample,
        "acceptance": {"sample_loss_max": sample_figs["loss"] + SAMPLE_LOSS_MARGIN,
                       "sample_mtp_p1_min": sample_figs["mtp_p1"] - SAMPLE_MTP_P1_MARGIN,
                       "margins": {"loss": SAMPLE_LOSS_MARGIN, "mtp_p1": SAMPLE_MTP_P1_MARGIN}},
        "completions": completions,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.log").unlink(missing_ok=True)
    log = Log(out / "train.log")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    import transformers

    log(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}, "
        f"device {hardware(device)}; args {vars(args)}")
    timing: dict[str, float] = {}
    t = time.perf_counter()

    stats = mini_corpus.CorpusStats()
    train_files, heldout = mini_corpus.collect(mini_corpus.source_trees(), args.heldout_permille,
                                               int(args.max_train_mb * 1e6), int(args.max_heldout_mb * 1e6),
                                               args.max_file_kb * 1000, stats)
    timing["corpus"] = time.perf_counter() - t
    log(f"corpus: {stats.train_files} train files ({stats.train_bytes / 1e6:.1f} MB), {stats.heldout_files} "
        f"held out ({stats.heldout_bytes / 1e6:.2f} MB); seen {stats.files_seen}, skipped {stats.skipped}")

    t = time.perf_counter()
    tok_texts, used = [], 0
    for f in train_files:
        if used >= args.tokenizer_mb * 1e6:
            break
        tok_texts.append(f.text)
        used += len(f.text.encode())
    stats.tokenizer_train_bytes = used
    tok = mini_corpus.train_tokenizer(tok_texts, args.vocab, SPECIAL_TOKENS)
    mini_corpus.save_tokenizer(tok, out, SPECIAL_TOKENS, max_len=32768)
    timing["tokenizer"] = time.perf_counter() - t
    t = time.perf_counter()
    train_stream = mini_corpus.encode(tok, train_files, EOS_ID)
    heldout_stream = mini_corpus.encode(tok, heldout, EOS_ID)
    stats.train_tokens, stats.heldout_tokens = len(train_stream), len(heldout_stream)
    timing["encode"] = time.perf_counter() - t
    log(f"tokenizer: vocab {tok.get_vocab_size()} on {used / 1e6:.1f} MB; train {len(train_stream):,} tokens, "
        f"held out {len(heldout_stream):,} ({timing['tokenizer']:.1f} s + {timing['encode']:.1f} s)")

    patches = [] if args.no_patches else train_patches.apply()
    if args.indexer_loss > 0:
        if args.no_patches:
            raise SystemExit("--indexer-loss needs the patched indexer: pass --indexer-loss 0 with --no-patches")
        patches.append(indexer_loss.apply())
    torch.manual_seed(args.seed)
    config = model_config("tiny" if args.tiny else "mini", vocab_size=tok.get_vocab_size())
    model, head = build_models(config, device)
    n_trunk, n_head = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in head.parameters())
    log(f"model: {n_trunk / 1e6:.2f} M trunk + {n_head / 1e6:.2f} M MTP parameters; patches: {patches or 'none'}")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the GDN's fp32 products while training

    t = time.perf_counter()
    run = train(args, model, head, train_stream, device, log)
    timing["train"] = time.perf_counter() - t

    # the weights go to disk before anything else can fail: an eval error must not lose the trained model
    round_to_bf16(model, head)
    saved_config = mini_card.save_checkpoint(model.cpu(), head.cpu(), out)
    model.to(device)
    head.to(device)
    features = ("GDN + QSA full attention (ratio {r}, budget {b}, inert bound {i}), PLE on layers {p}, {h} "
                "hyper-connection streams, MoE {e} experts top-{k} + shared expert, MTP head ({m} layer)").format(
        r=config["indexer_compress_ratio"], b=config["indexer_budget"],
        i=config["indexer_budget"] + config["indexer_compress_ratio"] - 1, p=config["ple_layer_ids"],
        h=config["hc_count"], e=config["num_experts"], k=config["num_experts_per_tok"],
        m=config["mtp_num_hidden_layers"])
    metrics = {
        "command": "python tools/train_mini.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": vars(args),
        "hardware": hardware(device),
        "software": f"torch {torch.__version__}, transformers {transformers.__version__}, "
                    f"python {platform.python_version()}",
        "features": features,
        "vocab_size": tok.get_vocab_size(),
        "parameters": {"trunk": n_trunk, "mtp": n_head},
        "corpus": stats.to_dict(),
        "training": {"seed": args.seed, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
                     "warmup": args.warmup, "weight_decay": args.weight_decay, "patches": patches,
                     "indexer_loss": args.indexer_loss,
                     "precision": "bf16 autocast, fp32 master weights and GDN math" if args.bf16 else "fp32",
                     "mtp": f"joint, on the detached trunk; soft-target weight {args.mtp_soft}",
                     **{k: v for k, v in run.items() if k != "curve"}},
        "loss_curve": run["curve"],
        "config": saved_config,
    }
    t = time.perf_counter()
    try:
        metrics.update(evaluate(args, model, head, tok, heldout, heldout_stream, device, log))
    except Exception as exc:  # keep what the run produced: the checkpoint is saved, the metrics say what failed
        import traceback

        log("eval failed:\n" + traceback.format_exc())
        metrics["eval_error"] = repr(exc)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
        raise SystemExit(1) from exc
    timing["eval"] = time.perf_counter() - t
    metrics["timing_s"] = {k: round(v, 2) for k, v in timing.items()}
    (out / "heldout_sample.json").write_text(json.dumps({"files": metrics.pop("sample_files"),
                                                         "figures": metrics["sample"]}, indent=1) + "\n")
    metrics["files"] = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out / "README.md").write_text(mini_card.model_card(metrics))
    log(f"wrote {sorted(p.name for p in out.iterdir())} to {out}; model.safetensors "
        f"{metrics['files']['model.safetensors'] / 2**20:.2f} MiB; total {time.perf_counter() - log.t0:.0f} s")
    return metrics


if __name__ == "__main__":
    main()
