"""Chat templates: the checkpoint's own (tokenizer_config.json or chat_template.jinja), else ChatML."""

from __future__ import annotations

import json

import pytest

from atlas.server.chat import ChatTemplate, load_chat_template
from atlas.server.errors import APIError

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_default_template_is_chatml_with_a_generation_prompt() -> None:
    text = ChatTemplate().render(MESSAGES)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not ChatTemplate().render(MESSAGES, add_generation_prompt=False).endswith("assistant\n")


def test_checkpoint_template_from_tokenizer_config(tmp_path) -> None:
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    loaded = load_chat_template(tmp_path)
    assert loaded.render(MESSAGES) == "<s>[SYSTEM] Be brief.</s>[USER] Hi</s>[ASSISTANT]"


def test_chat_template_jinja_file_wins_and_named_lists_use_default(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]}))
    assert load_chat_template(tmp_path).render(MESSAGES) == "DEFAULT"
    (tmp_path / "chat_template.jinja").write_text("FILE {{ messages | length }}")
    assert load_chat_template(tmp_path).render(MESSAGES) == "FILE 2"


def test_no_checkpoint_or_no_template_falls_back_to_the_default(tmp_path) -> None:
    assert load_chat_template(None).source == ChatTemplate().source
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert load_chat_template(tmp_path).source == ChatTemplate().source


def test_a_template_that_refuses_is_a_400_and_the_sandbox_holds() -> None:
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                          "{% endif %}ok")
    with pytest.raises(APIError) as info:
        strict.render(MESSAGES)
    assert info.value.status == 400 and "first must be user" in info.value.message
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(APIError):
        escape.render(MESSAGES)
