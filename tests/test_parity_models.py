"""Atlas's CPU backend against transformers, on tiny random checkpoints written by save_pretrained.

Each family's prompt is long enough that QSA selection is active (past the inert bound budget + ratio - 1)
and crosses EOS twice, so the PLE n-gram context restarts mid-prompt. Run with -s to see the figures.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from atlas.llm import LLM

FAMILIES = ["qwen3_next_dense", "qwen3_next_moe", "qwen3_5", "qwen3_5_moe", "qwen4_exp"]
TOLERANCE = 1e-4  # max abs logit difference, fp32
PROMPT_LEN = 48
EOS = 2  # conftest's checkpoints
# prefill widths: 1, and widths that are not multiples of the QSA ratio (4); the rest is decoded one by one
CHUNKS = [1, 3, 5, 7, 2, 6]


def _prompt(vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (PROMPT_LEN,), generator=g)
    ids[17] = EOS
    ids[30] = EOS
    return ids.tolist()


@pytest.fixture(scope="module")
def reference(hf_checkpoints):
    """family -> (LLM on the checkpoint, prompt, transformers' full-sequence logits [T, vocab])."""
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            path, hf_model = hf_checkpoints(family)
            ids = _prompt(hf_model.config.vocab_size)
            with torch.no_grad():
                ref = hf_model(torch.tensor([ids])).logits[0]
            cache[family] = (LLM(model=path), ids, ref)
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_full_prompt_logits_match_transformers(family, reference):
    llm, ids, ref = reference(family)
    diff = (llm.logits(ids) - ref).abs().max().item()
    print(f"\nPARITY {family:18s} full prompt ({len(ids)} tokens): max |dlogit| = {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_then_decode_matches_transformers(family, reference):
    llm, ids, ref = reference(family)
    widths = CHUNKS + [1] * (len(ids) - sum(CHUNKS))
    diff = (llm.logits(ids, chunk_sizes=widths) - ref).abs().max().item()
    print(f"\nPARITY {family:18s} prefill {CHUNKS} + {len(ids) - sum(CHUNKS)} decodes: max |dlogit| = {diff:.2e}")
    assert diff <= TOLERANCE


def _with_spec(llm: LLM, **changes) -> LLM:
    """The same weights under a changed spec (to show a feature's effect is real, not inert)."""
    other = object.__new__(LLM)
    other.model = attrs.evolve(llm.model, spec=attrs.evolve(llm.model.spec, **changes))
    other.backend = type(llm.backend)(other.model, num_kv_blocks=64)
    return other


def test_parity_prompt_exercises_qsa_selection_and_ple_restart(reference):
    """Guard against a parity test that passes because the features are inert on its prompt."""
    llm, ids, ref = reference("qwen4_exp")
    spec = llm.model.spec
    assert spec.qsa is not None and spec.ple is not None
    assert len(ids) > spec.qsa.inert_bound + 2 * spec.qsa.ratio
    dense = _with_spec(llm, qsa=attrs.evolve(spec.qsa, budget=1024))
    assert (dense.logits(ids) - ref).abs().max().item() > 100 * TOLERANCE
    # the n-gram context restarting at EOS matters too: with another EOS id the logits move
    no_restart = _with_spec(llm, ple=attrs.evolve(spec.ple, eos_token_id=EOS + 1))
    assert (no_restart.logits(ids) - ref).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_chunk_path_matches_transformers(family, reference):
    """The backend's fast path (exact=False: whole chunks through each op) against transformers too."""
    llm, ids, ref = reference(family)
    fast = object.__new__(LLM)
    fast.model = llm.model
    fast.backend = type(llm.backend)(llm.model, num_kv_blocks=64, exact=False)
    widths = CHUNKS + [len(ids) - sum(CHUNKS)]
    diff = (fast.logits(ids, chunk_sizes=widths) - ref).abs().max().item()
    print(f"\nPARITY {family:18s} whole chunks {widths}: max |dlogit| = {diff:.2e}")
    assert diff <= TOLERANCE
