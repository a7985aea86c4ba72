"""The stop checker's text is the same whether it is built every token or when it is read.

A request without stop strings puts its tokens through the per-token decode when its text is handed out
(StopChecker.later), and single-token decodes come from a memo shared by the book (StopChecker.pieces). Both must
give exactly the text of the old procedure, one decode of (the unread tokens + the new one) per token with the text
read whenever asked: checked here on trained byte-level BPE and Metaspace (SentencePiece-like) tokenizers, whose
decode depends on context, with multi-byte characters split across tokens, special tokens kept or skipped, and the
text read at random points (a streaming request) or only at the end (a held-back one)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from atlas.engine.stopping import StopChecker, decode
from atlas.model.tokenizer import HfTokenizer
from atlas.sampling.params import SamplingParams

CORPUS = ["héllo wörld, ça va? naïve café", "日本語のテキストです", "emoji 🎉🎈 and ∑∫ math", "plain ascii text here",
          "  leading spaces\tand\ttabs", "ünïcödé everywhere ßßß"]


class OldChecker:
    """The procedure before this change (copied): decode on every token, text read when asked."""

    def __init__(self, params: SamplingParams, tok: Any) -> None:
        self.params, self.tok = params, tok
        self.unread: list[int] = []
        self.text, self.emitted = "", 0

    def on_token(self, token: int, stop_ids: frozenset[int]) -> None:
        if token in stop_ids:
            return
        self.unread.append(token)
        piece = decode(self.tok, self.unread, self.params.skip_special_tokens)
        if not piece.endswith("\ufffd"):
            self.text += piece
            self.unread.clear()

    def take_text(self, finished: bool) -> str:
        if finished and self.unread:
            self.text += decode(self.tok, self.unread, self.params.skip_special_tokens)
            self.unread.clear()
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta


def _tokenizer(tmp_path: Path, kind: str) -> HfTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=kind == "metaspace", unk_token=None))
    special = ["<|endoftext|>", "<|im_start|>"]
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # SentencePiece-style: a leading "▁" stripped at the start of a decode, bytes as <0xNN> tokens
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    path = tmp_path / f"{kind}.json"
    tok.save(str(path))
    return HfTokenizer(path, eos_token_ids=(tok.token_to_id("<|endoftext|>"),))


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_text_built_late_and_memoised_is_the_text_built_every_token(tmp_path: Path, kind: str) -> None:
    tok = _tokenizer(tmp_path, kind)
    rng = random.Random(7)
    special = tok.special_tokens["<|im_start|>"]
    pieces: dict[bool, dict[int, str]] = {True: {}, False: {}}  # shared across requests, as RequestBook's
    split = context = 0
    for trial in range(120):
        ids = tok.encode(rng.choice(CORPUS) + " " + rng.choice(CORPUS))
        if trial % 3 == 0:  # random ids too: bytes that never complete a character, specials mid-text
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))] + ids[:5]
        if trial % 5 == 0:
            ids.insert(rng.randrange(len(ids) + 1), special)
        skip = trial % 2 == 0
        params = SamplingParams(max_tokens=1000, ignore_eos=True, skip_special_tokens=skip)
        new = StopChecker.create(params, 1000, tok.eos_token_ids, pieces[skip])
        old = OldChecker(params, tok)
        stream = trial % 4 != 0  # read the text at random points, or only at the end
        got, want = [], []
        for t in ids:
            assert new.on_token(t, tok) is None
            old.on_token(t, new.stop_ids)
            if stream and rng.random() < 0.4:
                got.append(new.take_text(False))
                want.append(old.take_text(False))
        got.append(new.take_text(True))
        want.append(old.take_text(True))
        assert got == want, (kind, trial, ids)
        split += any(decode(tok, [t], skip).endswith("\ufffd") for t in ids)
        context += "".join(decode(tok, [t], skip) for t in ids) != decode(tok, ids, skip)
    # what the checks exercised: characters split across tokens (byte-level: the held-back path), and a decode that
    # depends on context (Metaspace drops a piece's leading space at the start of a decode)
    assert split > 10 if kind == "bytelevel" else context > 10, (split, context)
    assert pieces[True] and pieces[False]


def test_stop_strings_still_see_the_text_every_token(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path, "bytelevel")
    params = SamplingParams(max_tokens=100, stop=("wörld",))
    checker = StopChecker.create(params, 100, tok.eos_token_ids, {})
    done = None
    for t in tok.encode("héllo wörld, ça va"):
        assert not checker.later  # a request with stop strings never defers its text
        done = checker.on_token(t, tok)
        if done is not None:
            break
    assert done is not None and done[1] == "stop string 'wörld'" and checker.take_text(True) == "héllo "
