"""Writing atlas-mini: the checkpoint (transformers' layout + Atlas's `mtp.*`, bf16) and its model card."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_checkpoint(model, head, out: Path) -> dict:
    """config.json + model.safetensors: save_pretrained's keys and layout (n-gram table shards, hashing buffers,
    tied lm_head dropped), every float tensor in bf16, plus the MTP head under `mtp.`. Returns the config."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
        config = json.loads((Path(tmp) / "config.json").read_text())
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    for name, value in head.state_dict().items():
        tensors["mtp." + name] = value.detach().to("cpu", torch.bfloat16).contiguous()
    config["dtype"] = "bfloat16"
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def _table(rows: list[list[str]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def model_card(m: dict) -> str:
    """README.md from metrics.json's dict: every figure the run produced."""
    c, t, e, s = m["corpus"], m["training"], m["heldout"], m["sample"]
    curve = m["loss_curve"]
    picks = sorted({round(i * (len(curve) - 1) / 9) for i in range(10)}) if curve else []
    curve_rows = [[str(curve[i]["step"]), f"{curve[i]['tokens'] / 1e6:.2f}", f"{curve[i]['elapsed_s']:.0f}",
                   f"{curve[i]['loss']:.3f}", f"{curve[i]['mtp_loss']:.3f}", f"{curve[i]['lr']:.2e}"] for i in picks]
    trees = [[name, c["trees"][name], str(c["files_seen"][name]), str(c["files_kept"][name]),
              f"{c['bytes_kept'][name] / 1e6:.1f}"] for name in c["trees"]]
    completions = "\n\n".join(f"```python\n{x['prompt']}{x['completion']}\n```" for x in m["completions"])
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in m["timing_s"].items())
    if t.get("indexer_loss", 0) > 0:
        indexer = ("The QSA indexer, which the language-model loss cannot train (its selection is a boolean mask), "
                   "learns by distillation (`tools/indexer_loss.py`, weight "
                   f"{t['indexer_loss']}): its block scores against its layer's dense attention summed per block, "
                   "KL over the queries whose selection is sparse, on a detached input.")
    else:
        indexer = ("The QSA indexer gets no gradient (its selection is a boolean mask): it selects by its initial "
                   "random projections, the same way in training and serving.")
    return f"""# atlas-mini

A small `qwen4_exp` model trained by Atlas itself (`tools/train_mini.py`), so that served outputs, MTP drafts,
n-gram drafts and content loops mean something. {m['parameters']['trunk'] / 1e6:.2f} M parameters
(+ {m['parameters']['mtp'] / 1e6:.2f} M in the MTP head), bf16, {m['files']['model.safetensors'] / 2**20:.1f} MiB.
Every feature Atlas serves: {m['features']}.

Trained on Python source only: it completes code; it does not chat (the chat template is there so the
serving path is complete).

## Held-out figures (fp32, the saved bf16 weights)

| what | value |
|---|---|
| held-out loss | **{e['loss']:.4f}** nats/token over {e['tokens']:,} tokens ({c['heldout_files']} held-out files) |
| held-out perplexity | **{e['perplexity']:.2f}** |
| next-token top-1 | {e['top1']:.3f} |
| MTP p1 (draft 1 = the trunk's argmax, teacher-forced) | **{e['mtp_p1']:.3f}** |
| MTP draft 1 = the text | {e['mtp_top1_text']:.3f} |
| test sample (`heldout_sample.json`, {s['tokens']} tokens) | loss {s['loss']:.4f}, MTP p1 {s['mtp_p1']:.3f} |

`metrics.json` holds these in machine-readable form; `tests/test_atlas_mini.py` checks the sample's loss and
MTP p1 through Atlas's CPU backend against them (+ the margins it states).

## Greedy completions of held-out function headers

transformers in fp32 on the saved weights (`mini_eval.greedy`: a full re-forward per token, {m['args']['completion_tokens']}
tokens at most), each prompt a header without its newline. A 5 M-parameter model loops at temperature 0; the
loops are what Atlas's content watchdog exists for.

{completions}

## Corpus

Python source on the training machine (`tools/mini_corpus.py`): every `*.py` under the interpreter's standard
library and site-packages, sorted, UTF-8, <= {m['args']['max_file_kb']} KB, no line over 1,000 characters,
byte-identical copies once. Held out BY FILE: blake2b of the tree-relative path, {m['args']['heldout_permille']} per
mille. Files are taken in hash order up to the byte caps.

{_table(trees, ['tree', 'path', '*.py files', 'kept', 'MB kept'])}

Skipped: {', '.join(f'{k} {v}' for k, v in sorted(c['skipped'].items())) or 'none'}.
Train: {c['train_files']} files, {c['train_bytes'] / 1e6:.1f} MB, {c['train_tokens']:,} tokens. Held out:
{c['heldout_files']} files, {c['heldout_bytes'] / 1e6:.1f} MB, {c['heldout_tokens']:,} tokens.
Tokenizer: byte-level BPE (`tokenizers`, GPT-2 pre-tokenizer), vocab {m['vocab_size']}, trained on the first
{c['tokenizer_train_bytes'] / 1e6:.1f} MB of the train files; {c['train_bytes'] / max(1, c['train_tokens']):.2f} bytes/token.

## Training

| what | value |
|---|---|
| hardware | {m['hardware']} |
| software | {m['software']} |
| seed | {t['seed']} |
| steps | {t['steps']} x batch {t['batch']} x {t['seq_len']} tokens = {t['tokens']:,} tokens ({t['epochs']:.2f} epochs) |
| wall time | {t['train_s']:.0f} s training ({t['tokens_per_s']:,.0f} tokens/s); phases: {timing} |
| optimiser | AdamW (betas 0.9/0.95, weight decay {t['weight_decay']} on matrices), lr {t['lr']:.1e}, {t['warmup_steps']} warm-up steps, cosine to 10%, clip 1.0 |
| precision | {t['precision']} |
| MTP head | {t['mtp']} |
| patches | {'; '.join(t['patches'])} |

The MTP head trains jointly, on the trunk's detached final hidden states and the detached shared embedding and
lm_head: the trunk's gradients are exactly those of its own loss (as if there were no head), while the head
learns from the same batches what it would learn on the frozen trunk afterwards, without a second pass over
the trunk; the cosine schedule's low-lr tail lets it settle on the final trunk. Its loss mixes the text's
t_{{k+2}} with the trunk's distribution at k + 1, since a greedy verify accepts a draft that equals the trunk's
argmax, not the text. {indexer}

Loss curve (mean train loss since the previous point; {len(curve)} points in metrics.json):

{_table(curve_rows, ['step', 'M tokens', 'elapsed s', 'loss', 'MTP loss', 'lr'])}

## Reproduce

`{m['command']}` (on the GPU: `bash tools/train_gpu.sh`, see tools/README.md). The corpus is whatever Python
source the machine holds, so another machine gives another corpus: the held-out loss reproduces within the
tolerance tools/README.md states, not bit for bit.
{_reruns(m, e)}"""


def _reruns(m: dict, e: dict) -> str:
    """The reruns recorded in metrics.json ("reruns": the reproduction checks), against this card's figures."""
    runs = m.get("reruns", [])
    if not runs:
        return ""
    rows = [[r["date"], r["command"], str(r["steps"]), f"{r['heldout_loss']:.4f}",
             f"{r['heldout_loss'] - e['loss']:+.4f}", f"{r['mtp_p1']:.3f}", f"{r['sample_loss']:.4f}", r["note"]]
            for r in runs]
    return ("\nReruns from a clean checkout (the reproduction check; weights not kept, this card's checkpoint is the "
            "first run's):\n\n" + _table(rows, ["date", "command", "steps", "held-out loss", "vs card", "MTP p1",
                                                  "sample loss", "note"]) + "\n")
