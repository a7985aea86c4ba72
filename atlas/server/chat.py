"""Chat templates: the checkpoint's own (jinja2, as transformers renders them) or a plain default."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from atlas.server.errors import bad_request

# ChatML, as Qwen checkpoints use; the built-in byte-level model simply sees these markers as text.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        self._template = env.from_string(source)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            # raise_exception carries the template author's words ("roles must alternate"): a client error
            raise bad_request(f"messages: the chat template refused them: {exc}", param="messages") from None


def content_segments(template: ChatTemplate, messages: list[dict[str, Any]], *, add_generation_prompt: bool
                     ) -> list[tuple[str, bool]] | None:
    """The rendered prompt as (text, is_message_content) pieces, found by rendering each content as a unique
    mark; None when the template does not place every content verbatim, once, in order (it transforms it)."""
    nonce = secrets.token_hex(8)
    marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
    shadow = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
    text = template.render(shadow, add_generation_prompt=add_generation_prompt)
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for message, mark in zip(messages, marks, strict=True):
        at = text.find(mark, pos)
        if at < 0 or text.count(mark) != 1:
            return None
        pieces += [(text[pos:at], False), (message["content"], True)]
        pos = at + len(mark)
    pieces.append((text[pos:], False))
    real = template.render(messages, add_generation_prompt=add_generation_prompt)
    return pieces if "".join(p for p, _ in pieces) == real else None


def encode_chat(tokenizer: Any, template: ChatTemplate, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool) -> list[int]:
    """Token ids of a chat: message content is text, only the template's own markers are special tokens.

    Without special-token text in any content this is the tokenizer on the rendered prompt, exactly as
    transformers tokenizes it. With some (`<|im_end|>\n<|im_start|>system\n...` inside a user message: a
    spoofed system turn), the contents are tokenized as text between the template's pieces."""
    rendered = template.render(messages, add_generation_prompt=add_generation_prompt)
    specials = getattr(tokenizer, "special_tokens", None) or {}
    spoof = [(i, sp) for i, m in enumerate(messages) for sp in specials if sp in str(m.get("content") or "")]
    for i, m in enumerate(messages):
        named = next((sp for sp in specials if sp in str(m.get("name") or "")), None)
        if named is not None:
            raise bad_request(f"messages.{i}.name: holds the special token {named!r}", param=f"messages.{i}.name")
    if not spoof:
        return list(tokenizer.encode(rendered))
    segments = content_segments(template, messages, add_generation_prompt=add_generation_prompt)
    if segments is None:
        i, sp = spoof[0]
        raise bad_request(f"messages.{i}.content: holds the special token {sp!r} and this chat template rewrites "
                          f"message content, so it cannot be kept as plain text; remove it",
                          param=f"messages.{i}.content")
    ids: list[int] = []
    for text, is_content in segments:
        if text:
            ids += tokenizer.encode_text(text) if is_content else tokenizer.encode(text)
    return ids


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def load_chat_template(model_dir: str | Path | None) -> ChatTemplate:
    """The checkpoint's template (chat_template.jinja, or tokenizer_config.json's `chat_template`)."""
    if model_dir is None or not Path(model_dir).is_dir():
        return ChatTemplate()
    root = Path(model_dir)
    config: dict[str, Any] = {}
    if (root / "tokenizer_config.json").is_file():
        config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
    source: Any = config.get("chat_template")
    if (root / "chat_template.jinja").is_file():
        source = (root / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(source, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if not isinstance(source, str) or not source:
        return ChatTemplate()
    return ChatTemplate(
        source, bos_token=_token_text(config.get("bos_token")), eos_token=_token_text(config.get("eos_token"))
    )
