"""Evaluation of atlas-mini after training: held-out loss, MTP agreement, greedy completions, the test sample.

Every figure is computed in fp32 (no autocast, no TF32) on the weights as saved (rounded to bf16), so the CPU
tests, which load the saved checkpoint into Atlas and transformers, can check the same numbers.
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch
import torch.nn.functional as F
from mini_mtp import mtp_pairs

_HEADER = re.compile(r"^def [A-Za-z_]\w*\(.*\)( -> .+)?:$")


@torch.no_grad()
def trunk_and_mtp(model, head, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] -> (trunk logits [B, T, V], draft logits [B, T-1, V]: row k drafts t_{k+2})."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    embed, pair_hidden = mtp_pairs(model.model.embed_tokens.weight, hidden, ids)
    return model.lm_head(hidden), model.lm_head(head(embed, pair_hidden))


def sequence_figures(model, head, ids: torch.Tensor) -> dict[str, float]:
    """Sums over one batch [B, T]: next-token NLL and top-1 hits, and the MTP head's agreement with the trunk.

    mtp_p1 is the greedy acceptance of draft 1 on teacher-forced text: row k's argmax against the trunk's argmax
    at position k + 1 (the token a greedy verify of that draft compares with)."""
    logits, drafts = trunk_and_mtp(model, head, ids)
    logits, drafts = logits.float(), drafts.float()
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    target_next = logits.argmax(-1)
    draft_top = drafts[:, :-1].argmax(-1)  # rows 0 .. T-3 (t_{k+2} exists)
    return {
        "nll": nll.item(),
        "tokens": ids[:, 1:].numel(),
        "top1": (target_next[:, :-1] == ids[:, 1:]).sum().item(),
        "mtp_rows": draft_top.numel(),
        "mtp_agree": (draft_top == target_next[:, 1:-1]).sum().item(),
        "mtp_text": (draft_top == ids[:, 2:]).sum().item(),
    }


def heldout_figures(model, head, stream: np.ndarray, seq_len: int, batch: int, max_tokens: int,
                    device: torch.device) -> dict[str, float]:
    """Non-overlapping windows of the held-out stream (up to max_tokens): loss, perplexity, top-1, MTP p1."""
    windows = min(len(stream) // seq_len, max(1, max_tokens // seq_len))
    if windows == 0:
        raise ValueError(f"the held-out stream ({len(stream)} tokens) is shorter than one window of {seq_len}")
    data = torch.from_numpy(stream[: windows * seq_len].astype(np.int64)).view(windows, seq_len)
    total: dict[str, float] = {}
    for i in range(0, windows, batch):
        for k, v in sequence_figures(model, head, data[i : i + batch].to(device)).items():
            total[k] = total.get(k, 0) + v
    loss = total["nll"] / total["tokens"]
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(total["tokens"]),
            "top1": total["top1"] / total["tokens"], "mtp_p1": total["mtp_agree"] / total["mtp_rows"],
            "mtp_top1_text": total["mtp_text"] / total["mtp_rows"]}


def sample_files(heldout, limit_tokens: int, tok) -> list[dict]:
    """A few whole held-out files (their start, cut at a line end) for the CPU tests: about limit_tokens."""
    out, used = [], 0
    for f in heldout:
        if used >= limit_tokens:
            break
        lines, text = f.text.splitlines(keepends=True), ""
        for line in lines:
            if len(tok.encode(text + line).ids) > min(512, limit_tokens - used):
                break
            text += line
        n = len(tok.encode(text).ids)
        if n >= 64:  # long enough to cross the QSA inert bound
            out.append({"key": f.key, "text": text, "tokens": n})
            used += n
    return out


def sample_figures(model, head, tok, files: list[dict], device: torch.device) -> dict[str, float]:
    """What tests/test_atlas_mini.py recomputes: each sample file on its own, summed over the files."""
    total: dict[str, float] = {}
    for f in files:
        ids = torch.tensor([tok.encode(f["text"]).ids], device=device)
        for k, v in sequence_figures(model, head, ids).items():
            total[k] = total.get(k, 0) + v
    return {"loss": total["nll"] / total["tokens"], "tokens": int(total["tokens"]),
            "mtp_p1": total["mtp_agree"] / total["mtp_rows"], "mtp_rows": int(total["mtp_rows"])}


def completion_prompts(heldout, count: int) -> list[str]:
    """`def fibonacci(n):` and the first top-level function headers of held-out files, without their newline: the
    byte-level BPE folds a newline into the indentation that follows it ("\\n   " is one token), so a prompt that
    ends in a bare "\\n" asks for what follows a newline at column 0 (the card's first run completed every header
    with another header)."""
    prompts = ["def fibonacci(n):"]
    for f in heldout:
        for line in f.text.splitlines():
            if _HEADER.match(line) and len(line) < 80:
                prompts.append(line)
                break
        if len(prompts) > count:
            break
    return prompts


@torch.no_grad()
def greedy(model, tok, prompt: str, new_tokens: int, eos_ids: tuple[int, ...], device: torch.device) -> str:
    """Greedy continuation by full re-forward each token (no cache: the path training ran, nothing else)."""
    ids = tok.encode(prompt).ids
    start = len(ids)
    for _ in range(new_tokens):
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, -1]
        nxt = int(logits.argmax())
        if nxt in eos_ids:
            break
        ids.append(nxt)
    return tok.decode(ids[start:])
