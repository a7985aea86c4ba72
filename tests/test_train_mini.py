"""tools/train_mini.py end to end at a toy size: corpus -> tokenizer -> training -> eval -> the eight files,
which Atlas then loads and scores as the run did. (The GPU run is the same code with the mini preset.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
         "metrics.json", "heldout_sample.json", "train.log"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for this module: its ops are small, and a second thread only adds a barrier wait to each
    (on a loaded 2-core machine that wait made a 3-step run take 75 s instead of 12 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TOY = ["--device", "cpu", "--tiny", "--steps", "3", "--threads", "1", "--max-train-mb", "0.3",
       "--max-heldout-mb", "0.1", "--tokenizer-mb", "0.1", "--vocab", "512", "--batch", "4", "--seq-len", "64",
       "--eval-tokens", "512", "--sample-tokens", "200", "--completion-tokens", "2", "--log-every", "1"]


def _main(args: list[str]) -> dict:
    import train_mini
    import train_patches

    try:
        return train_mini.main(args)
    finally:
        train_patches.restore()  # the run patched transformers' module; leave it as other tests expect


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mini")
    return out, _main([*TOY, "--out", str(out)])


def test_writes_the_eight_files_and_the_figures(run):
    out, metrics = run
    assert {p.name for p in out.iterdir()} == FILES
    assert metrics["training"]["steps"] == 3 and len(metrics["loss_curve"]) == 3
    assert metrics["corpus"]["train_tokens"] > 0 and metrics["corpus"]["heldout_files"] > 0
    assert all(c["prompt"] for c in metrics["completions"])
    assert metrics["completions"][0]["prompt"] == "def fibonacci(n):"  # no newline: BPE folds it into the indent
    assert json.loads((out / "metrics.json").read_text())["heldout"] == metrics["heldout"]
    card = (out / "README.md").read_text()
    assert f"{metrics['heldout']['loss']:.4f}" in card and "def fibonacci(n):" in card
    # held out by file: no held-out file is a training file
    sample = json.loads((out / "heldout_sample.json").read_text())
    assert sample["files"] and all(f["key"].startswith(("stdlib/", "site-packages/", "platlib/"))
                                   for f in sample["files"])


def test_atlas_loads_the_run_and_scores_the_sample_as_the_run_did(run):
    from atlas.backends.cpu import Chunk, CpuBackend
    from atlas.model import load_model

    out, metrics = run
    model = load_model(out)
    assert model.has_mtp and model.spec.qsa is not None and model.spec.ple is not None
    backend = CpuBackend(model, num_kv_blocks=64, exact=False)
    nll = count = 0.0
    for f in json.loads((out / "heldout_sample.json").read_text())["files"]:
        ids = model.tokenizer.encode(f["text"])
        logits = backend.forward([Chunk(0, ids, 0, tuple(range(-(-len(ids) // 16))))])[0]
        backend.release(0)
        nll += torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
        count += len(ids) - 1
    assert count == metrics["sample"]["tokens"]
    assert abs(nll / count - metrics["sample"]["loss"]) < 1e-3


def test_an_eval_failure_keeps_the_trained_checkpoint(tmp_path, monkeypatch):
    import mini_eval

    def broken(*args, **kwargs):
        raise RuntimeError("eval broke")

    monkeypatch.setattr(mini_eval, "heldout_figures", broken)
    with pytest.raises(SystemExit):
        _main([*TOY, "--steps", "1", "--out", str(tmp_path)])
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "train.log",
            "metrics.json"} <= {p.name for p in tmp_path.iterdir()}
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert "eval broke" in metrics["eval_error"] and metrics["training"]["steps"] == 1
    assert "eval failed" in (tmp_path / "train.log").read_text()
