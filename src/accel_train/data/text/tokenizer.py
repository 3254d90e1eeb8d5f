"""Text <-> token ids for a token folder (`train.bin`, `val.bin`, `meta.json`).

Two kinds, named by `meta.json`'s `tokenizer` key:
- `char`: one id per character, the vocabulary (`itos`: id -> character) listed in meta.json
  itself (nanoGPT's shakespeare_char layout; `../shared/data/pycode` is one);
- `bpe`: a byte-level BPE of the `tokenizers` library, its `tokenizer.json` beside meta.json.

Loading either reads JSON only: a token folder never runs code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np

from accel_train.errors import UserError

META = "meta.json"
TOKENIZER_FILE = "tokenizer.json"  # a bpe folder's tokenizer, beside meta.json
UINT16_MAX_VOCAB = 65_536  # ids 0..65535 fit uint16; a larger vocabulary is stored as uint32


class Tokenizer(Protocol):
    kind: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: list[int]) -> str: ...

    def meta(self) -> dict: ...


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"


class CharTokenizer:
    kind = "char"

    def __init__(self, itos: list[str]):
        self.itos = itos
        self.stoi = {c: i for i, c in enumerate(itos)}
        self.vocab_size = len(itos)
        # Code point -> id as one array: encoding is a numpy gather, not a Python loop.
        self._lookup = np.full(max(map(ord, itos), default=0) + 1, -1, dtype=np.int64)
        self._lookup[[ord(c) for c in itos]] = np.arange(len(itos))

    @classmethod
    def train(cls, text: str) -> CharTokenizer:
        return cls(sorted(set(text)))

    def unknown(self, text: str) -> list[str]:
        """The characters of `text` outside the vocabulary (in order of appearance)."""
        return list(dict.fromkeys(c for c in text if c not in self.stoi))

    def encode(self, text: str) -> np.ndarray:
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        inside = points < len(self._lookup)
        ids = np.where(inside, self._lookup[np.where(inside, points, 0)], -1)
        if (ids < 0).any():
            missing = self.unknown(text)
            raise UserError(
                f"{len(missing)} character(s) are not in this character vocabulary: "
                f"{''.join(missing[:20])!r}. A char tokenizer knows only the characters of the "
                "text it was made from."
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.itos[i] for i in ids)

    def meta(self) -> dict:
        return {"tokenizer": "char", "itos": self.itos}


class BpeTokenizer:
    kind = "bpe"

    def __init__(self, tokenizer):  # a tokenizers.Tokenizer
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    @staticmethod
    def _library():
        try:
            import tokenizers
        except ImportError:
            raise UserError(
                'a BPE tokenizer needs the `tokenizers` library: pip install "accel-train[lm]" '
                "(or use tokenizer=char)."
            ) from None
        return tokenizers

    @classmethod
    def train(cls, chunks, vocab_size: int) -> BpeTokenizer:
        """A byte-level BPE learned from an iterator of text chunks (any byte can be encoded, so
        no text is out of vocabulary)."""
        tk = cls._library()
        tokenizer = tk.Tokenizer(tk.models.BPE())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(chunks, trainer=trainer)
        return cls(tokenizer)

    @classmethod
    def from_file(cls, path: Path) -> BpeTokenizer:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"{path}: cannot read the tokenizer file ({err}).") from None
        return cls.from_json(text, str(path))

    @classmethod
    def from_json(cls, text: str, where: str) -> BpeTokenizer:
        """A tokenizer.json's text (from a file, or kept in a shard index); `where` names it."""
        tk = cls._library()
        try:
            return cls(tk.Tokenizer.from_str(text))
        except Exception as err:  # noqa: BLE001 - the library's own parse errors, any type
            raise UserError(
                f"{where} is not a tokenizer file the `tokenizers` library can read ({err}). "
                "Pass a tokenizer.json saved by `tokenizers` (Tokenizer.save) or by Hugging "
                "Face's `save_pretrained`."
            ) from None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text).ids, dtype=np.int64)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def meta(self) -> dict:
        return {"tokenizer": "bpe", "tokenizer_file": TOKENIZER_FILE}

    def save(self, folder: Path) -> None:
        self.tokenizer.save(str(folder / TOKENIZER_FILE))


def read_meta(folder: Path) -> dict:
    """A token folder's meta.json, checked: a one-paragraph error naming the file."""
    path = Path(folder) / META
    if not path.is_file():
        raise UserError(
            f"{path} not found: a token folder holds train.bin, val.bin and meta.json. Make one "
            "with `accel-data tokenize input=<text file> out=<folder>`."
        )
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}). Tokenize the text again.") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("vocab_size"), int):
        raise UserError(f"{path} has no integer `vocab_size`. Tokenize the text again.")
    if meta["vocab_size"] < 1:
        raise UserError(
            f"{path}: vocab_size={meta['vocab_size']} must be a positive number of token ids. "
            "Tokenize the text again, or set it to the tokenizer's vocabulary size."
        )
    if meta.get("dtype", "uint16") not in ("uint16", "uint32"):
        raise UserError(f"{path}: dtype must be uint16 or uint32, not {meta.get('dtype')!r}.")
    return meta


def load_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer a token folder was made with (JSON only: nothing is executed)."""
    meta, bpe_json = tokenizer_description(Path(folder))
    return tokenizer_from_meta(meta, str(Path(folder) / META), bpe_json)


def tokenizer_description(folder: Path) -> tuple[dict, str | None]:
    """A token folder's tokenizer as plain data: its meta.json and, for a BPE, the text of its
    tokenizer.json (what tokenizer_from_meta rebuilds it from; what a checkpoint keeps)."""
    meta = read_meta(folder)
    if meta.get("tokenizer") != "bpe":
        return meta, None
    path = folder / meta.get("tokenizer_file", TOKENIZER_FILE)
    try:
        return meta, path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read the tokenizer file ({err}).") from None


def tokenizer_from_meta(meta: dict, where: str, bpe_json: str | None = None) -> Tokenizer:
    """The tokenizer a meta.json describes: a char vocabulary is in it, a BPE's tokenizer.json
    is given as text (a shard index keeps it; `where` names what the meta came from)."""
    kind = meta.get("tokenizer", "char" if "itos" in meta else None)
    if kind == "char" and isinstance(meta.get("itos"), list):
        return CharTokenizer([str(c) for c in meta["itos"]])
    if kind == "bpe" and bpe_json is not None:
        return BpeTokenizer.from_json(bpe_json, where)
    raise UserError(
        f"{where} names no tokenizer this version reads (`tokenizer`: char with an `itos` list, "
        "or bpe with its tokenizer.json)."
    )
