"""Tokenizers: `tokenizer.json` through the `tokenizers` library, else a byte-level one.

Both expose encode(str) -> list[int], decode(list[int]) -> str, eos_token_ids and vocab_size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are bytes; specials follow. Decoding never fails on partial UTF-8 (it yields U+FFFD)."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

    def __init__(self, vocab_size: int = 320) -> None:
        if vocab_size < 256 + len(self.SPECIALS):
            raise ValueError(f"a byte tokenizer needs vocab_size >= {256 + len(self.SPECIALS)}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.special_ids = {name: 256 + i for i, name in enumerate(self.SPECIALS)}
        self.eos_token_id = self.special_ids["<|endoftext|>"]
        self.eos_token_ids = (self.eos_token_id, self.special_ids["<|im_end|>"])

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode_bytes(self, token_ids: list[int]) -> bytes:
        """The raw bytes of the byte ids (specials and ids past the specials are dropped)."""
        return bytes(t for t in token_ids if 0 <= t < 256)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return self.decode_bytes(token_ids).decode("utf-8", errors="replace")
        names = {v: k for k, v in self.special_ids.items()}
        parts: list[str] = []
        run: list[int] = []
        for t in token_ids:
            if 0 <= t < 256:
                run.append(t)
                continue
            parts.append(bytes(run).decode("utf-8", errors="replace"))
            run = []
            parts.append(names.get(t, f"<|unused_{t}|>"))
        parts.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(parts)


class HfTokenizer:
    """A checkpoint's `tokenizer.json`, through the `tokenizers` library."""

    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...]) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        self._text_tok: _Tokenizer | None = None  # a copy that parses no special tokens (encode_text)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = eos_token_ids

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """`text` as text: a special token's string in it is not that token (chat message content)."""
        if self._text_tok is None:
            from tokenizers import Tokenizer as _Tokenizer

            self._text_tok = _Tokenizer.from_str(self._tok.to_str())
            self._text_tok.encode_special_tokens = True
        return self._text_tok.encode(text, add_special_tokens=False).ids

    @property
    def special_tokens(self) -> dict[str, int]:
        """The special tokens' strings, which `encode` turns into their ids."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(checkpoint_dir: str | Path | None, eos_token_ids: tuple[int, ...], vocab_size: int) -> Tokenizer:
    """`tokenizer.json` when the dir has one, else bytes. EOS ids: the config's, plus generation_config's."""
    if checkpoint_dir is not None:
        root = Path(checkpoint_dir)
        eos = list(eos_token_ids)
        gen = root / "generation_config.json"
        if gen.is_file():
            extra = json.loads(gen.read_text()).get("eos_token_id")
            for t in extra if isinstance(extra, list) else [extra] if extra is not None else []:
                if t not in eos:
                    eos.append(int(t))
        if (root / "tokenizer.json").is_file():
            return HfTokenizer(root / "tokenizer.json", tuple(eos))
    byte_tok = ByteTokenizer(max(vocab_size, 256 + len(ByteTokenizer.SPECIALS)))
    if eos_token_ids:
        byte_tok.eos_token_ids = tuple(dict.fromkeys((*eos_token_ids, *byte_tok.eos_token_ids)))
    return byte_tok
