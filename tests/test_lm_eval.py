"""lm-evaluation-harness (a dev dependency) runs a local multiple-choice task through its `local-completions`
model against a served atlas-tiny (issue 17, finding 8): remote tokenizer (/tokenizer_info, /tokenize), batches
of prompts, echo + logprobs. Every loglikelihood it scores must be the exact forward's (atlas.LLM.logits), and
its accuracy the one those give. No network: the task's data is a local JSON file."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from atlas.config import EngineConfig
from atlas.registry import build_engine
from atlas.server.serve import Served, serve_in_thread

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "fixtures" / "lm_eval"  # the task the README's evaluation block runs too
DOCS = [json.loads(line) for line in (TASKS / "docs.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    torch.set_num_threads(1)
    config = EngineConfig(max_seq_len=128, max_batch_size=8, prefill_chunk_tokens=64, enable_prefix_caching=True)
    with serve_in_thread(build_engine("atlas-tiny", "cpu", config)) as s:
        yield s


def _loglikelihood(logp: torch.Tensor, context: list[int], continuation: list[int]) -> float:
    return float(sum(logp[len(context) + i - 1, t] for i, t in enumerate(continuation)))


def test_lm_eval_runs_a_local_multiple_choice_task(served: Served, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from atlas.llm import LLM

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.chdir(ROOT)  # the task's data path is relative to the repository root
    model_args = (f"base_url={served.url}/v1/completions,model=atlas-tiny,tokenizer_backend=remote,"
                  "tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=128")
    out = simple_evaluate(model="local-completions", model_args=model_args, tasks=["atlas_tiny_mc"],
                          task_manager=TaskManager(include_path=str(TASKS), include_defaults=False), batch_size=4,
                          log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                          fewshot_random_seed=0)
    assert out is not None
    samples = out["samples"]["atlas_tiny_mc"]
    assert len(samples) == len(DOCS)

    llm = LLM("atlas-tiny")
    correct = 0
    for sample in samples:
        doc = DOCS[sample["doc_id"]]
        context = list(doc["question"].encode())
        scores = []
        for choice, resp in zip(doc["choices"], sample["resps"], strict=True):
            tokens = context + list(choice.encode())
            logp = torch.log_softmax(llm.logits(tokens).double(), dim=-1)
            expected = _loglikelihood(logp, context, list(choice.encode()))
            got = resp[0][0]  # (loglikelihood, is_greedy)
            assert got == pytest.approx(expected, abs=1e-9)
            scores.append(expected)
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    acc = out["results"]["atlas_tiny_mc"]["acc,none"]
    assert acc == pytest.approx(correct / len(DOCS))
    assert os.environ["HF_HUB_OFFLINE"] == "1"
