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

from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from accel_train.data.splits import Splits
from accel_train.data.streaming import (
    META,
    StreamingEvalSplit,
    StreamingSource,
    StreamingTrainSplit,
    check_shards,
    open_shard_set,
    read_meta,
)
from accel_train.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_meta
from accel_train.data.tokens import token_folder
from accel_train.errors import UserError


class _Windows:
    """A window of block_size + 1 tokens (LitData's item) -> (inputs, targets) as int64."""

    def __call__(self, item: Any, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(np.asarray(item, dtype=np.int64))
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
        StreamingSource(remote, "train", cache, limit, _Windows(), tokens_per_item=window),
        indices=range(windows["train"]),
    )
    n_val = max(1, min(int(eval_windows), windows["val"]))
    val_starts = np.linspace(0, windows["val"] - 1, n_val).round().astype(np.int64)
    val = StreamingEvalSplit(
        StreamingSource(remote, "val", cache, limit, _Windows(), tokens_per_item=window),
        indices=sorted(set(val_starts.tolist())),
    )
    splits = Splits(train, val, None, in_channels=0, image_size=0, num_classes=0)
    splits.model_args = {"vocab_size": int(meta["tokens"]["vocab_size"])}
    return splits


def dataset_tokenizer(ds: DictConfig, data_dir: str | None) -> tuple[Tokenizer, str]:
    """The tokenizer a language model's data set was made with, and where it was read from: a
    token folder's meta.json (dataset=tokens) or the copy a token shard set keeps in its index
    (dataset=streaming_tokens)."""
    if ds.get("remote"):
        remote = str(ds.remote).rstrip("/")
        meta = read_meta(remote, kind="tokens")
        where = f"{remote}/{META}"
        return tokenizer_from_meta(meta["tokens"], where, meta.get("tokenizer_json")), where
    folder = token_folder(str(ds.path), data_dir)
    return load_tokenizer(folder), str(folder / "meta.json")
