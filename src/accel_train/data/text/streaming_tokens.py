"""`dataset=streaming_tokens`: token shards written by `accel-data shard dataset=tokens`, read
with LitData's StreamingDataset and its TokensLoader (as litgpt reads its pretraining data) from
a local folder or an object store, through dataset=streaming's bounded cache.

- Training: LitData cuts each chunk into consecutive windows of block_size + 1 tokens (the last
  few tokens of a chunk, fewer than a window, are not read); the input is a window's first
  block_size tokens, the target the same shifted by one. The order, the split between ranks and
  workers, the cache and the exact mid-epoch resume are dataset=streaming's: the same
  StreamingLoader reads them (LitData shuffles chunks and windows by seed and epoch).
- Validation: `eval_windows` windows evenly spaced over the val split, the same in every run.

The vocabulary comes from the shard index, which keeps the token folder's meta.json (and a BPE
tokenizer's tokenizer.json), so neither training nor `accel-sample` needs the token folder.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import torch

from accel_train.data.shards.reader import StreamingEvalSplit, StreamingSource, StreamingTrainSplit
from accel_train.data.shards.shard_set import check_shards, open_shard_set
from accel_train.data.splits import Splits
from accel_train.data.text.tokens import check_token_ids, window_splits
from accel_train.errors import UserError

try:
    from litdata.streaming.item_loader import TokensLoader
except ImportError:  # the `stream` extra: open_shard_set names it before anything is read
    TokensLoader = object


class LockedTokensLoader(TokensLoader):
    """LitData 0.2.76's TokensLoader with its bookkeeping of open chunks under a lock.

    When the cache is smaller than the data, LitData's download thread deletes a used chunk
    (`delete`) while the reading thread closes the same chunk (`close`); both take its memory
    map out of the same dicts, unlocked, and the loser fails with `KeyError: <chunk>` (about one
    run in ten of the small-cache test, three at a time on 2 cores, failed in `close`). Taking a
    lock around the three methods that change those dicts is what an upstream fix would do.
    Waiting for a download happens outside the lock, so the download thread is never blocked
    by a reader waiting for it."""

    def __init__(self, block_size: int | None = None):
        super().__init__(block_size)
        self._lock = threading.RLock()

    def _load_chunk(self, chunk_index, chunk_filepath) -> None:
        with self._lock:
            super()._load_chunk(chunk_index, chunk_filepath)

    def close(self, chunk_index) -> None:
        with self._lock:
            super().close(chunk_index)

    def delete(self, chunk_index, chunk_filepath) -> None:
        with self._lock:
            super().delete(chunk_index, chunk_filepath)

    def __getstate__(self):  # to loader workers: a lock does not pickle
        return {**self.__dict__, "_lock": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.RLock()


# LitData checks a data set's loader against the one its index.json names by class name: ours
# answers to TokensLoader's (pickle finds it by __qualname__, which is unchanged).
LockedTokensLoader.__name__ = "TokensLoader"


class _Windows:
    """A window of block_size + 1 tokens (LitData's item) -> (inputs, targets) as int64, its
    ids checked against the vocabulary."""

    def __init__(self, vocab_size: int, where: str):
        self.vocab_size, self.where = vocab_size, where

    def __call__(self, item: Any, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = np.asarray(item, dtype=np.int64)
        check_token_ids(
            ids,
            self.vocab_size,
            f"dataset.remote: a window of the shards {self.where}",
            "Shard the token folder again (`accel-data shard dataset=tokens ... overwrite=true`).",
        )
        window = torch.from_numpy(ids)
        return window[:-1], window[1:]


def build_streaming_tokens(
    *,
    remote: str,
    block_size: int,
    local: str | None = None,
    cache_limit: Any = "20gb",
    eval_windows: int = 200,
    seed: int = 0,
    **_,
) -> Splits:
    """The `dataset=streaming_tokens` splits (see the module docstring)."""
    remote, meta, cache, limit = open_shard_set(remote, local, cache_limit, "tokens")
    window = int(block_size) + 1
    vocab_size = int(meta["tokens"]["vocab_size"])
    windows = {}
    for name in ("train", "val"):
        index = check_shards(remote, name, int(meta["splits"][name]["samples"]))
        # LitData's TokensLoader reads dim // window whole windows of each chunk.
        windows[name] = sum(int(c.get("dim") or 0) // window for c in index.get("chunks", []))
        if windows[name] == 0:
            raise UserError(
                f"dataset.remote={remote}: no chunk of the {name} split holds a window of "
                f"block_size + 1 = {window} tokens. Use a smaller `model.block_size`, or shard "
                "again with larger chunks (`accel-data shard ... chunk_bytes=64MB`)."
            )
    train = StreamingTrainSplit(
        StreamingSource(
            remote, "train", cache, limit, _Windows(vocab_size, remote), windows_of(window)
        ),
        indices=range(windows["train"]),
    )
    n_val = max(1, min(int(eval_windows), windows["val"]))
    val_starts = np.linspace(0, windows["val"] - 1, n_val).round().astype(np.int64)
    val = StreamingEvalSplit(
        StreamingSource(
            remote, "val", cache, limit, _Windows(vocab_size, remote), windows_of(window)
        ),
        indices=sorted(set(val_starts.tolist())),
    )
    return window_splits(train, val, vocab_size)


def windows_of(tokens: int):
    """A maker of item loaders that read the shards as consecutive windows of `tokens`."""
    return functools.partial(LockedTokensLoader, tokens)
