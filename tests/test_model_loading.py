"""Loading checkpoints: layouts Atlas accepts, and the named errors for the ones it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file

from atlas.errors import ModelLoadError
from atlas.llm import LLM
from atlas.model import load_model
from atlas.model.tiny import save
from atlas.model.tokenizer import ByteTokenizer, load_tokenizer


@pytest.fixture()
def tiny_dir(tmp_path: Path) -> Path:
    return save(tmp_path / "tiny")


def _edit_config(root: Path, **changes) -> None:
    config = json.loads((root / "config.json").read_text())
    config.update(changes)
    (root / "config.json").write_text(json.dumps(config))


def _edit_tensors(root: Path, edit) -> None:
    tensors = load_file(str(root / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(root / "model.safetensors"))


def test_unsupported_model_type_lists_the_supported_ones(tiny_dir):
    _edit_config(tiny_dir, model_type="llama")
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'llama'; supported: .*qwen3_5.*qwen3_next.*qwen4_exp"):
        load_model(tiny_dir)


def test_missing_tensor_is_named(tiny_dir):
    _edit_tensors(tiny_dir, lambda t: t.pop("model.layers.3.self_attn.indexer.index_qk_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor layers\.3\.self_attn\.indexer\.index_qk_proj\.weight"):
        load_model(tiny_dir)


def test_missing_expert_is_named(tiny_dir, hf_checkpoints, tmp_path):
    src, _ = hf_checkpoints("qwen3_next_moe")
    root = tmp_path / "moe"
    root.mkdir()
    (root / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in tensors  # save_pretrained writes per-expert tensors
    tensors.pop("model.layers.0.mlp.experts.3.up_proj.weight")
    save_file(tensors, str(root / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensor layers\.0\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(root)


def test_shape_mismatch_names_both_shapes(tiny_dir):
    def shrink(t):
        t["model.layers.0.linear_attn.out_proj.weight"] = t["model.layers.0.linear_attn.out_proj.weight"][:, :-1].contiguous()

    _edit_tensors(tiny_dir, shrink)
    with pytest.raises(
        ModelLoadError, match=r"shape mismatch for layers\.0\.linear_attn\.out_proj\.weight: checkpoint \(64, 63\), expected \(64, 64\)"
    ):
        load_model(tiny_dir)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, r"rope_parameters\.rope_type='yarn'"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ({"indexer_kv_heads": 2}, r"indexer_kv_heads=2"),
        ({"indexer_budget": 18}, r"indexer_budget=18 .* multiple of indexer_compress_ratio=4"),
        ({"ple_layer_ids": [4]}, r"ple_layer_ids=\[4\]"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, r"layer_types=\['sliding_attention'\]"),
    ],
)
def test_unhonourable_config_values_are_named(tiny_dir, changes, message):
    _edit_config(tiny_dir, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model(tiny_dir)


def test_sharded_checkpoint_loads_the_same_weights(hf_checkpoints, tmp_path):
    src, hf_model = hf_checkpoints("qwen3_5")
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = load_model(src), load_model(sharded)
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert a.fingerprint == b.fingerprint


def test_multimodal_config_with_nested_text_config(tiny_dir, tmp_path):
    """qwen4_exp's multimodal layout: text config under `text_config`, weights under model.language_model."""
    root = tmp_path / "mm"
    root.mkdir()
    text = json.loads((tiny_dir / "config.json").read_text())
    config = {"model_type": "qwen4_exp", "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (root / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)  # a vision tower Atlas ignores
    save_file(renamed, str(root / "model.safetensors"))
    mm = load_model(root)
    tiny = load_model(tiny_dir)
    assert mm.spec.model_type == "qwen4_exp" and attrs.evolve(mm.spec, model_type="qwen4_exp_text") == tiny.spec
    assert all(torch.equal(mm.weights[k], tiny.weights[k]) for k in tiny.weights)
    ids = list(b"nested text config")
    assert torch.equal(LLM(root).logits(ids), LLM(tiny_dir).logits(ids))


def test_byte_tokenizer_round_trips_and_survives_partial_utf8():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    partial = tok.decode(ids[:2])  # "h" + the first byte of "é"
    assert partial.startswith("h") and partial.endswith("\ufffd")
    assert tok.decode([*ids, tok.eos_token_id]) == text
    assert tok.decode([tok.eos_token_id], skip_special_tokens=False) == "<|endoftext|>"
    assert tok.eos_token_id in tok.eos_token_ids


def test_tokenizer_json_is_used_when_present(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, "hello": 1, "world": 2, "[UNK]": 3}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = load_tokenizer(tmp_path, eos_token_ids=(0,), vocab_size=4)
    assert tok.encode("hello world") == [1, 2]
    assert tok.eos_token_ids == (0, 2)
    assert load_tokenizer(None, (256,), 320).encode("a") == [97]


def test_tied_embeddings_serve_the_lm_head(tiny_dir):
    _edit_config(tiny_dir, tie_word_embeddings=True)
    _edit_tensors(tiny_dir, lambda t: t.pop("lm_head.weight"))
    model = load_model(tiny_dir)
    assert torch.equal(model.weights["lm_head.weight"], model.weights["embed_tokens.weight"])
    _edit_config(tiny_dir, tie_word_embeddings=False)
    with pytest.raises(ModelLoadError, match=r"missing tensor lm_head\.weight"):
        load_model(tiny_dir)


def test_atlas_mini_loads_by_name_from_the_repo_dir(tiny_dir, tmp_path, monkeypatch):
    """"atlas-mini" stands for the repo's models/atlas-mini; without a checkpoint there the error says where it
    comes from. (tests/test_atlas_mini.py checks the real checkpoint when it is there.)"""
    import atlas.model.loader as loader

    assert loader.MINI_MODEL_DIR == Path(loader.__file__).resolve().parents[2] / "models" / "atlas-mini"
    empty = tmp_path / "atlas-mini"
    empty.mkdir()
    monkeypatch.setattr(loader, "MINI_MODEL_DIR", empty)
    with pytest.raises(ModelLoadError, match=r"atlas-mini: no checkpoint in .*tools/train_mini.py"):
        load_model("atlas-mini")
    monkeypatch.setattr(loader, "MINI_MODEL_DIR", tiny_dir)
    assert loader.model_dir("atlas-mini") == tiny_dir
    assert loader.model_dir("atlas-tiny") is None and loader.model_dir(tmp_path) == tmp_path
    assert load_model("atlas-mini").fingerprint == load_model(tiny_dir).fingerprint
