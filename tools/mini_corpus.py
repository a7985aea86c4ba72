"""The training corpus and tokenizer of atlas-mini, built deterministically from Python source on the machine.

Trees: the running interpreter's standard library (`sysconfig.get_paths()["stdlib"]`, without any
site-packages below it) and its site-packages (purelib, and platlib when it differs), walked in sorted order.
Files that are not UTF-8, larger than `max_file_bytes`, or hold a line longer than 1,000 characters
(generated tables) are skipped, and byte-identical copies are kept once.

Split BY FILE: blake2b of "tree/relative/path" decides, so a file's side never depends on which other files
exist. The same hash orders the files, so when a byte cap cuts the corpus the kept files are a spread over
every package rather than an alphabetical prefix; of byte-identical copies the first in that order is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git"}
MAX_LINE = 1000


@dataclass
class SourceFile:
    key: str  # "tree/relative/path": the split and the order hash this
    text: str


@dataclass
class CorpusStats:
    trees: dict[str, str] = field(default_factory=dict)  # tree name -> path
    files_seen: dict[str, int] = field(default_factory=dict)  # per tree, every *.py
    files_kept: dict[str, int] = field(default_factory=dict)  # per tree, read and kept (up to the caps)
    bytes_kept: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    train_files: int = 0
    train_bytes: int = 0
    heldout_files: int = 0
    heldout_bytes: int = 0
    train_tokens: int = 0
    heldout_tokens: int = 0
    tokenizer_train_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def source_trees() -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    trees = [("stdlib", Path(paths["stdlib"])), ("site-packages", Path(paths["purelib"]))]
    if Path(paths["platlib"]).resolve() != Path(paths["purelib"]).resolve():
        trees.append(("platlib", Path(paths["platlib"])))
    return [(name, p) for name, p in trees if p.is_dir()]


def _walk(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return found


def _rank(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def _read(path: Path) -> tuple[str | None, str]:
    """(text, "") or (None, why it is skipped)."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None, "unreadable"
    if not raw.strip():
        return None, "empty"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not utf-8"
    if max(map(len, text.splitlines()), default=0) > MAX_LINE:
        return None, "long line"
    return text, ""


def collect(trees: list[tuple[str, Path]], heldout_permille: int, max_train_bytes: int, max_heldout_bytes: int,
            max_file_bytes: int, stats: CorpusStats) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held-out) files, each in hash order and cut at its byte cap. Files are read in hash order and
    only until both caps are full, so a machine with a GB of site-packages costs a walk, not a GB of reads."""
    keyed: list[tuple[int, str, Path]] = []
    for name, root in trees:
        stats.trees[name] = str(root)
        files = _walk(root)
        stats.files_seen[name] = len(files)
        stats.files_kept[name] = stats.bytes_kept[name] = 0
        for path in files:
            key = f"{name}/{path.relative_to(root).as_posix()}"
            keyed.append((_rank(key), key, path))
    keyed.sort()
    sides: dict[bool, list[SourceFile]] = {False: [], True: []}
    held = {False: 0, True: 0}
    caps = {False: max_train_bytes, True: max_heldout_bytes}
    seen: set[bytes] = set()
    for rank, key, path in keyed:
        if all(caps[s] - held[s] < 256 for s in sides):  # both full (to within a small file)
            break
        side = rank % 1000 < heldout_permille
        try:
            size = path.stat().st_size
        except OSError:
            size = -1
        if size > max_file_bytes:
            stats.skipped["too large"] = stats.skipped.get("too large", 0) + 1
            continue
        if size > caps[side] - held[side]:
            continue  # passes the filters, but not what is left of this side's cap
        text, why = _read(path)
        digest = hashlib.blake2b(text.encode(), digest_size=16).digest() if text is not None else b""
        if text is not None and digest in seen:
            text, why = None, "duplicate"
        if text is None:
            stats.skipped[why] = stats.skipped.get(why, 0) + 1
            continue
        seen.add(digest)
        size = len(text.encode())
        sides[side].append(SourceFile(key, text))
        held[side] += size
        tree = key.split("/", 1)[0]
        stats.files_kept[tree] += 1
        stats.bytes_kept[tree] += size
    stats.train_files, stats.train_bytes = len(sides[False]), held[False]
    stats.heldout_files, stats.heldout_bytes = len(sides[True]), held[True]
    return sides[False], sides[True]


def train_tokenizer(texts: list[str], vocab_size: int, special_tokens: tuple[str, ...]):
    """Byte-level BPE (GPT-2's pre-tokenizer regex: indentation runs become tokens), specials at ids 0..n-1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode(tok, files: list[SourceFile], eos_id: int, batch: int = 512) -> np.ndarray:
    """One token stream: each file's ids followed by EOS (so PLE's n-gram context restarts per file)."""
    parts: list[np.ndarray] = []
    for i in range(0, len(files), batch):
        chunk = files[i : i + batch]
        for enc in tok.encode_batch_fast([f.text for f in chunk], add_special_tokens=False):
            parts.append(np.asarray(enc.ids + [eos_id], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(tok, out_dir: Path, special_tokens: tuple[str, ...], max_len: int) -> None:
    """tokenizer.json + tokenizer_config.json (a chat template, the specials), as transformers expects them."""
    tok.save(str(out_dir / "tokenizer.json"))
    eos, _, im_end, pad = special_tokens
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in special_tokens}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "bos_token": None,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in special_tokens if t not in (eos, pad)],
        "chat_template": CHAT_TEMPLATE,
    }
    if im_end not in config["additional_special_tokens"]:
        raise ValueError(f"{im_end} must be a special token")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
