"""`dataset=tokens`: a token folder (`train.bin`, `val.bin`, `meta.json`; made by `accel-data
tokenize`, or nanoGPT's prepare scripts) as windows of `block_size + 1` tokens: the input is the
first `block_size`, the target the same shifted by one.

- Training: `windows_per_epoch` windows an epoch, each starting at a position drawn from a
  generator seeded by (seed, epoch): window i of epoch e is always the same, so a resumed run sees
  exactly the windows it would have, and since the loader's order hands each rank its own window
  indices, DDP ranks draw different windows.
- Validation: `eval_windows` windows evenly spaced over val.bin, the same in every run, so val
  losses compare between runs.

The files are memory-mapped (numpy), opened lazily in each process that reads them (the loader's
workers too): nothing is loaded whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from accel_train.data.splits import Splits
from accel_train.data.text.tokenizer import read_meta
from accel_train.errors import UserError


def token_count(path: Path, dtype: str) -> int:
    """The tokens of a .bin file, checked: a byte count that is not a whole number of tokens
    (a truncated copy, or meta.json naming another dtype) is one paragraph naming the file."""
    size, width = path.stat().st_size, np.dtype(dtype).itemsize
    if size % width:
        raise UserError(
            f"{path} holds {size:,} bytes, not a whole number of {dtype} tokens ({width} bytes "
            f"each, the dtype of {path.parent / 'meta.json'}): the file is truncated or was "
            "written with another dtype. Tokenize the text again (`accel-data tokenize "
            f"input=<text> out={path.parent} overwrite=true`)."
        )
    return size // width


class TokenWindows(Dataset):
    def __init__(self, path: Path, dtype: str, block_size: int, starts: np.ndarray | None, n: int):
        self.path, self.dtype, self.block_size = path, dtype, block_size
        self.vocab_size = 0  # meta.json's: ids at or above it are refused (0: not checked)
        self.fixed = starts  # evaluation: these windows; training: None (drawn per epoch)
        self.n = n  # windows in the split (per epoch, for training)
        self.tokens = token_count(Path(path), dtype)
        self.seed = 0
        # dataset.document_separator: positions restart after this id (None: one stream)
        self.separator: int | None = None
        self._data: np.memmap | None = None
        self._epoch_starts: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.n

    def _memmap(self) -> np.memmap:
        if self._data is None:  # opened in the process that reads (a loader worker too)
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._data

    def starts(self, epoch: int) -> np.ndarray:
        if self.fixed is not None:
            return self.fixed
        if self._epoch_starts is None or self._epoch_starts[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            high = self.tokens - self.block_size - 1
            self._epoch_starts = (epoch, rng.integers(0, high + 1, size=self.n))
        return self._epoch_starts[1]

    def getitem(self, i: int, epoch: int) -> tuple[Any, torch.Tensor]:
        start = int(self.starts(epoch)[i])
        chunk = np.asarray(self._memmap()[start : start + self.block_size + 1], dtype=np.int64)
        check_token_ids(
            chunk,
            self.vocab_size,
            f"{self.path} (tokens {start}-{start + len(chunk)})",
            "Tokenize the text again (`accel-data tokenize ... overwrite=true`).",
        )
        window = torch.from_numpy(chunk)
        x, y = window[:-1], window[1:]
        if self.separator is None:
            return x, y
        return {"input_ids": x, "position_ids": document_positions(x, self.separator)}, y

    def __getitem__(self, i: int) -> tuple[Any, torch.Tensor]:
        return self.getitem(i, 0)

    def __getstate__(self):  # to loader workers: without the open memmap
        return {**self.__dict__, "_data": None}


def document_positions(x: torch.Tensor, separator: int) -> torch.Tensor:
    """Each token's position in its document: 0 after every `separator` (the window's first
    token counts from 0 too: the model sees no further back than the window)."""
    t = x.shape[-1]
    starts = torch.zeros(t, dtype=torch.long)
    after = (x == separator).nonzero().flatten() + 1  # a document starts after a separator
    after = after[after < t]
    starts[after] = after
    return torch.arange(t) - torch.cummax(starts, 0).values


def token_splits(
    path: str,
    block_size: int,
    windows_per_epoch: int = 0,
    eval_windows: int = 200,
    seed: int = 0,
    document_separator: int | None = None,
    data_dir: str | None = None,
) -> Splits:
    """The `dataset=tokens` splits of the folder `path` (relative paths: to the current directory,
    else to paths.data_dir). windows_per_epoch 0 = train.bin's tokens // block_size.
    `document_separator`: the id that ends each document; the windows then carry positions
    that restart after it, and the model keeps each document's attention to itself."""
    folder = token_folder(path, data_dir)
    meta = read_meta(folder)
    dtype = meta.get("dtype", "uint16")
    vocab = int(meta["vocab_size"])
    if document_separator is not None and not 0 <= document_separator < vocab:
        raise UserError(
            f"dataset.document_separator={document_separator} is not a token id of {folder} "
            f"(its vocabulary has ids 0-{vocab - 1}). Give the id that ends each document "
            "(GPT-2's <|endoftext|> is 50256), or null for one stream of text."
        )
    sets = {}
    for name in ("train", "val"):
        file = folder / f"{name}.bin"
        if not file.is_file():
            raise UserError(f"{file} not found: a token folder holds train.bin and val.bin.")
        tokens = file.stat().st_size // np.dtype(dtype).itemsize
        if tokens < block_size + 1:
            raise UserError(
                f"{file} holds {tokens} tokens, fewer than one window of block_size + 1 = "
                f"{block_size + 1}. Use a smaller `model.block_size` or more text."
            )
        if name == "train":
            n = windows_per_epoch or max(1, tokens // block_size)
            sets[name] = TokenWindows(file, dtype, block_size, None, n)
            sets[name].seed = seed
        else:
            n = max(1, min(eval_windows, tokens - block_size))
            starts = np.linspace(0, tokens - block_size - 1, n).astype(np.int64)
            sets[name] = TokenWindows(file, dtype, block_size, starts, n)
        sets[name].vocab_size = vocab
        sets[name].separator = document_separator
    return window_splits(sets["train"], sets["val"], int(meta["vocab_size"]))


def window_splits(train, val, vocab_size: int, test=None) -> Splits:
    """A language model's splits: no image shape and no classes; the model is told the
    vocabulary (dataset=tokens, streaming_tokens, sft, streaming_sft, and accel-sample
    rebuilding the model)."""
    shape = {"in_channels": 0, "image_size": 0, "num_classes": 0}
    return Splits(
        train, val, test, **shape, model_args={"vocab_size": vocab_size}, only_task="language_model"
    )


def check_token_ids(window: np.ndarray, vocab_size: int, where: str, fix: str) -> None:
    """A token id at or above the vocabulary would index past the model's embedding: an
    IndexError deep in the forward on the CPU, a device-side assert on CUDA. Checked on the
    host as each window is read (a max over block_size + 1 ids, in the loader)."""
    if vocab_size and window.size and int(window.max()) >= vocab_size:
        raise UserError(
            f"{where} holds token id {int(window.max())}, but the vocabulary has {vocab_size} "
            "ids (meta.json's vocab_size): the tokens and their meta.json do not belong together "
            f"(another tokenizer, the wrong dtype, or a damaged file). {fix}"
        )


def token_folder(path: str, data_dir: str | None) -> Path:
    folder = Path(path)
    if not folder.is_dir() and data_dir and (Path(data_dir) / path).is_dir():
        folder = Path(data_dir) / path
    if not folder.is_dir():
        raise UserError(
            f"dataset.path={path}: no such folder. Point it at a token folder (train.bin, "
            "val.bin, meta.json), e.g. one made by `accel-data tokenize input=<text> "
            "out=<folder>`."
        )
    return folder
