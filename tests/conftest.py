"""Shared fixtures: tiny random transformers checkpoints, written once per test session."""

from __future__ import annotations

import math
import os
import zlib
from pathlib import Path

import pytest
import torch

# one torch thread per worker: bin/test runs two xdist workers on a 2-core machine, so a second intra-op thread
# only waits at each op's barrier for a core the other worker holds (atlas/threads.py measured 4-11x slower then);
# was 2 per worker (4 threads on 2 cores): see the commit for the suite's worker-seconds before and after
torch.set_num_threads(1)
# the state-digest audit mode in every backend the tests build (atlas.backends.base.state_audit_default)
os.environ.setdefault("ATLAS_STATE_AUDIT", "1")
# without a GPU the kernel tests run Triton through its CPU interpreter. Set here, before any test module imports
# triton: each kernel test module also sets it before its own imports, but a module collected earlier that imports
# triton first (tests/test_kernels_compile.py's importorskip) left the kernel modules after it uninterpreted in the
# same process ("Cannot call @triton.jit'd outside of the scope of a kernel": test_kernels_moe.py run after it, 9
# failed). test_kernels_compile.py strips it from its compiling subprocess.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Every weight random, norm weights included (transformers initialises RMSNorm weights to zeros), at
    scales that keep activations and logits O(1) so parity is meaningful."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.0, 1.5, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("linear_attn.norm.weight"):  # the gated norm is not zero-centred
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # zero-centred RMSNorm weights
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.dim() != 3 or "conv" not in name else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / math.sqrt(fan_in)))


def _small_common() -> dict:
    return dict(
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_conv_kernel_dim=4,
        eos_token_id=2,
        rms_norm_eps=1e-6,
    )


def build_hf_model(family: str) -> torch.nn.Module:
    import transformers as tf

    c = _small_common()
    if family == "qwen3_next_dense":
        cfg = tf.Qwen3NextConfig(**c, intermediate_size=48, num_experts=0,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.25})
        model = tf.Qwen3NextForCausalLM(cfg)
    elif family == "qwen3_next_moe":
        cfg = tf.Qwen3NextConfig(**c, intermediate_size=48, num_experts=6, num_experts_per_tok=2,
                                 moe_intermediate_size=16, shared_expert_intermediate_size=24, mlp_only_layers=[1],
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5})
        model = tf.Qwen3NextForCausalLM(cfg)
    elif family == "qwen3_5":
        cfg = tf.Qwen3_5TextConfig(**c, intermediate_size=48,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                                    "mrope_interleaved": True})
        model = tf.Qwen3_5ForCausalLM(cfg)
    elif family == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeTextConfig(**c, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.25})
        model = tf.Qwen3_5MoeForCausalLM(cfg)
    elif family == "qwen4_exp":
        cfg = tf.Qwen4ExpTextConfig(
            **c, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            hc_count=2, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=16, ngram_size=3, heads_per_ngram=2,
            ngram_vocab_size_base=101, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4,
            indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        )
        model = tf.Qwen4ExpForCausalLM(cfg)
    else:
        raise ValueError(family)
    _randomise(model, seed=zlib.crc32(family.encode()))
    return model.eval()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """family -> (checkpoint dir, the transformers model that wrote it); built lazily, once per session."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(family: str) -> tuple[Path, torch.nn.Module]:
        if family not in cache:
            model = build_hf_model(family)
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            cache[family] = (path, model)
        return cache[family]

    return get


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files holding a `slow` test go first, the README's clone run first of all, so that with bin/test's
    `--dist loadfile --no-loadscope-reorder` the two workers start on the long files and the many short ones fill in
    behind them; in collection order (or xdist's default most-tests-first order) test_readme.py's clone run, the
    single longest test, started last and alone decided the wall time."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}

    def rank(item: pytest.Item) -> int:
        if item.path.name == "test_readme.py":
            return 0
        return 1 if item.path in slow_files else 2

    items.sort(key=rank)  # stable: collection order within a rank and within each file
