"""tools/indexer_loss.py: the QSA indexer's distillation loss trains the indexer and nothing else."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import indexer_loss
import train_patches
from mini_config import model_config
from mini_mtp import build_models
from test_train_patches import _randomise


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def patched():
    train_patches.apply()
    indexer_loss.apply()
    yield
    train_patches.restore()
    indexer_loss.restore()


def _model():
    model, _ = build_models(model_config("tiny", vocab_size=320), torch.device("cpu"))
    _randomise(model, 21)
    ids = torch.randint(4, 320, (2, 90), generator=torch.Generator().manual_seed(2))
    return model, ids


def _grads(model, ids, with_indexer_loss: bool):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    idx = indexer_loss.collect(ids.device)
    (loss + idx if with_indexer_loss else loss).backward()
    return logits.detach(), idx.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                           if p.grad is not None}


def test_trains_the_indexer_only_and_leaves_the_forward_alone(patched):
    model, ids = _model()
    logits, idx, grads = _grads(model, ids, with_indexer_loss=True)
    assert idx.item() > 0 and torch.isfinite(idx)
    indexer = {n for n in grads if ".indexer." in n}
    assert indexer and all(grads[n].abs().sum() > 0 for n in indexer)
    indexer_loss.restore()  # the fast indexer alone: same selection, no loss
    ref_logits, ref_idx, ref_grads = _grads(model, ids, with_indexer_loss=False)
    assert ref_idx.item() == 0.0 and not any(".indexer." in n for n in ref_grads)
    assert torch.equal(logits, ref_logits)
    for name, ref in ref_grads.items():  # every other gradient is the LM loss's own
        assert torch.allclose(grads[name], ref, rtol=0, atol=1e-7), name


def test_distillation_loss_is_zero_at_the_target_and_finite_everywhere():
    g = torch.Generator().manual_seed(3)
    ratio, topk, seq = 4, 2, 30
    target = torch.rand(1, seq, seq // ratio, generator=g)
    visible = train_patches.visible_blocks(seq, ratio, torch.device("cpu"))
    target = target.masked_fill(~visible, 0.0)
    exact = (target / target.sum(-1, keepdim=True).clamp_min(1e-12)).clamp_min(1e-30).log()
    assert indexer_loss.distillation_loss(exact, target, ratio, topk).item() == pytest.approx(0.0, abs=1e-6)
    scores = torch.randn(1, seq, seq // ratio, generator=g, requires_grad=True)
    loss = indexer_loss.distillation_loss(scores, target, ratio, topk)
    loss.backward()
    assert loss.item() > 0.01 and torch.isfinite(scores.grad).all()
    # rows of queries that are dense anyway (<= topk complete blocks) carry no gradient
    assert scores.grad[0, : (topk + 1) * ratio - 1].abs().sum() == 0
    short = torch.randn(1, 5, 1, requires_grad=True)  # no sparse query at all
    assert indexer_loss.distillation_loss(short, torch.rand(1, 5, 1), ratio, topk).item() == 0.0


def test_a_few_steps_on_the_indexer_lower_its_loss(patched):
    model, ids = _model()
    params = [p for n, p in model.named_parameters() if ".indexer." in n]
    opt = torch.optim.Adam(params, lr=3e-2)
    losses = []
    for _ in range(8):
        model(input_ids=ids, use_cache=False)
        loss = indexer_loss.collect(ids.device)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
