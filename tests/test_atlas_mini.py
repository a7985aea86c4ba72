"""atlas-mini, the checkpoint tools/train_mini.py trains (models/atlas-mini): it loads by name with every
feature, agrees with transformers, and scores on held-out code what its model card (metrics.json) records.

The held-out files it is scored on travel with it (heldout_sample.json: held out by path hash on the training
machine, never trained on), so the figures are checked where the checkpoint is, not where it was trained.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from atlas.model.loader import MINI_MODEL_DIR, MINI_MODEL_NAME

pytestmark = pytest.mark.skipif(
    not (MINI_MODEL_DIR / "config.json").is_file(),
    reason=f"no checkpoint in {MINI_MODEL_DIR} (no config.json): it comes from the GPU run (bash tools/train_gpu.sh, "
           "see tools/README.md)",
)
TOLERANCE = 1e-4  # max |dlogit| against transformers, fp32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for this module: its ops are small, and a second thread only adds a barrier wait to each
    (on a loaded 2-core machine that wait made a 3-step run take 75 s instead of 12 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def mini():
    """(LLM, a whole-chunk backend, metrics.json, heldout_sample.json, [(ids, final hidden [n, H]) per file]).

    Whole chunks (exact=False) agree with the exact token-by-token path to ~1e-6 (tests/test_parity_models.py
    checks both against transformers on every family) and score the sample's ~1,000 tokens in about a second."""
    from atlas.backends.cpu import Chunk, CpuBackend
    from atlas.llm import LLM

    llm = LLM(MINI_MODEL_NAME, num_kv_blocks=128)
    fast = CpuBackend(llm.model, num_kv_blocks=128, exact=False)
    metrics = json.loads((MINI_MODEL_DIR / "metrics.json").read_text())
    sample = json.loads((MINI_MODEL_DIR / "heldout_sample.json").read_text())
    scored = []
    for f in sample["files"]:
        ids = llm.model.tokenizer.encode(f["text"])
        table = tuple(range(-(-len(ids) // fast.block_size)))
        try:
            scored.append((ids, fast.forward_hidden([Chunk(-1, ids, 0, table)])[0]))
        finally:
            fast.release(-1)
    return llm, fast, metrics, sample, scored


def test_loads_by_name_with_every_feature(mini):
    llm, _, metrics, sample, _ = mini
    model, spec = llm.model, llm.model.spec
    assert model.name == MINI_MODEL_NAME and spec.family == "qwen4_exp"
    assert spec.qsa is not None and spec.ple is not None and spec.moe is not None and spec.hc_count >= 2
    assert spec.gdn_layers and spec.attention_layers and model.has_mtp
    assert model.tokenizer.vocab_size == spec.vocab_size == metrics["vocab_size"]
    text = "def fibonacci(n):\n    return n\n"
    assert model.tokenizer.decode(model.tokenizer.encode(text)) == text
    assert (MINI_MODEL_DIR / "model.safetensors").stat().st_size <= 12 * 2**20
    assert "chat_template" in json.loads((MINI_MODEL_DIR / "tokenizer_config.json").read_text())
    # the sample crosses the QSA inert bound, so selection is active when it is scored
    assert min(f["tokens"] for f in sample["files"]) > spec.qsa.inert_bound + 2 * spec.qsa.ratio


def test_parity_against_transformers_on_heldout_code(mini):
    import transformers as tf

    llm, fast, _, _, scored = mini
    spec = llm.model.spec
    files = [ids for ids, _ in scored]
    # two held-out files across an EOS: PLE's n-gram context restarts at 30, QSA selection is on past 35
    ids = files[0][:30] + [spec.eos_token_ids[0]] + (files[1] if len(files) > 1 else files[0][30:])[:170]
    hf = tf.Qwen4ExpForCausalLM.from_pretrained(MINI_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0]
    other = object.__new__(type(llm))
    other.model, other.backend = llm.model, fast
    diff = (other.logits(ids) - ref).abs().max().item()
    # the exact (token-by-token) path the engine serves, on a prefix past both (it costs ~50 ms a token here)
    short = spec.qsa.inert_bound + 3 * spec.qsa.ratio
    exact = (llm.logits(ids[:short]) - ref[:short]).abs().max().item()
    print(f"\nPARITY atlas-mini: {len(ids)} held-out tokens whole-chunk max |dlogit| = {diff:.2e}, "
          f"first {short} exact = {exact:.2e}")
    assert diff <= TOLERANCE and exact <= TOLERANCE


def test_heldout_loss_is_the_model_cards(mini):
    _, fast, metrics, _, scored = mini
    head = fast.weights["lm_head.weight"]
    nll, count = 0.0, 0
    for ids, hidden in scored:
        logits = hidden @ head.T
        nll += torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    loss = nll / count
    print(f"\natlas-mini held-out sample: {count} tokens, loss {loss:.4f} (card {metrics['sample']['loss']:.4f})")
    assert count == metrics["sample"]["tokens"]
    assert loss <= metrics["acceptance"]["sample_loss_max"]
    assert loss < math.log(metrics["vocab_size"]) - 1.0  # far from a uniform guess: it learned something


def test_mtp_p1_on_heldout_code_above_the_cards_floor(mini):
    """Draft 1 from pair key k (embed(t_{k+1}), h_k) against the trunk's argmax at k + 1: what a greedy verify
    of that draft would accept, on teacher-forced held-out code."""
    _, fast, metrics, _, scored = mini
    head = fast.weights["lm_head.weight"]
    agree = rows = 0
    for ids, hidden in scored:
        target = (hidden @ head.T).argmax(-1)
        drafts, _ = fast.mtp_forward(hidden[:-1], ids[1:])
        agree += int((drafts[:-1].argmax(-1) == target[1:-1]).sum())
        rows += len(ids) - 2
    p1 = agree / rows
    print(f"\natlas-mini MTP p1 on {rows} held-out rows: {p1:.3f} (card {metrics['sample']['mtp_p1']:.3f})")
    assert rows == metrics["sample"]["mtp_rows"]
    assert p1 >= metrics["acceptance"]["sample_mtp_p1_min"]


def test_the_readme_shows_what_atlas_mini_answers_to_def_fibonacci(mini):
    """The quick start's completion of `def fibonacci(n):` (greedy, 48 tokens) is what the engine produces, and it
    is Python-shaped: an indented block under the header."""
    from pathlib import Path

    from atlas.sampling.params import SamplingParams

    llm = mini[0]
    (out,) = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=48, temperature=0.0))
    text = "def fibonacci(n):" + out.text
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f"```\n{text}\n```" in readme, text
    body = out.text.splitlines()[1:]
    assert body and all(line.startswith("    ") or not line.strip() for line in body), text
