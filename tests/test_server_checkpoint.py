"""Serving a checkpoint directory: its name, its chat template, its vocabulary."""

from __future__ import annotations

import json
import shutil

import httpx

from atlas.config import EngineConfig
from atlas.registry import build_engine
from atlas.server.chat import load_chat_template
from atlas.server.serve import serve_in_thread

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<bot>{% endif %}")


def test_a_checkpoint_is_served_with_its_own_name_and_chat_template(hf_checkpoints, tmp_path) -> None:
    source, _ = hf_checkpoints("qwen3_5")
    model_dir = tmp_path / "my-checkpoint"
    shutil.copytree(source, model_dir)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    config = EngineConfig(max_seq_len=128, max_batch_size=4)
    engine = build_engine(str(model_dir), backend="cpu", config=config)
    with serve_in_thread(engine, chat_template=load_chat_template(model_dir)) as served, \
            httpx.Client(base_url=served.url, timeout=60) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["my-checkpoint"]
        messages = [{"role": "user", "content": "hi"}]
        rendered = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        assert rendered == http.post("/tokenize", json={"prompt": "<user>hi<bot>"}).json()["tokens"]
        r = http.post("/v1/chat/completions", json={"model": "my-checkpoint", "messages": messages, "max_tokens": 4,
                                                    "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": len(rendered), "completion_tokens": 4,
                                     "total_tokens": len(rendered) + 4}
        vocab = engine.tokenizer.vocab_size
        refused = http.post("/v1/completions", json={"prompt": [vocab], "max_tokens": 1})
        assert refused.status_code == 400 and str(vocab) in refused.json()["error"]["message"]
