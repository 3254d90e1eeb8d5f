"""`dataset=streaming_sft`: instruction rows written by `accel-data shard dataset=sft`, streamed
with LitData from a local folder or an object store through dataset=streaming's bounded cache.

The records are tokenized once, when the shard set is written (with the model folder's
tokenizer and chat template, masked, cut and packed by data/text/sft.py exactly as `dataset=sft`
does), so no training process reads the JSON, tokenizes, or holds the whole set: each streams
its share of the rows. A shard item is one row (`input_ids`, `labels`, and `position_ids` when
packed), int32. The order, the split between ranks and workers, the cache and the exact
mid-epoch resume are dataset=streaming's.

The shard index keeps a fingerprint of the tokenizer (its vocabulary, special tokens and chat
template): training with a model folder whose tokenizer differs is refused before the first
step, since its embedding rows would not mean the ids the rows hold.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from accel_train.data.shards.reader import StreamingEvalSplit, StreamingSource, StreamingTrainSplit
from accel_train.data.shards.shard_set import check_shards, open_shard_set
from accel_train.data.splits import Splits
from accel_train.data.text.sft import tokenizer_fingerprint
from accel_train.data.text.tokens import check_token_ids, window_splits
from accel_train.errors import UserError
from accel_train.models.hf import load_tokenizer

log = logging.getLogger("accel_train")


def row_item(row: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> dict:
    """One shard item from an SFT row (LitData's optimize calls this in its writer processes)."""
    x, y, pos = row
    item = {"input_ids": x.numpy(), "labels": y.numpy()}
    if pos is not None:
        item["position_ids"] = pos.numpy()
    return item


class _Row:
    """A shard item -> the row `dataset=sft` would give: (input_ids, labels), or
    ({input_ids, position_ids}, labels) when packed; ids checked against the vocabulary, and
    the label of untrained tokens the shards were written with (`written`) made the task's."""

    def __init__(self, vocab_size: int, where: str, written: int, ignore: int):
        self.vocab_size, self.where = vocab_size, where
        self.written, self.ignore = written, ignore

    def __call__(self, item: dict, epoch: int) -> Any:
        ids = np.asarray(item["input_ids"], dtype=np.int64)
        check_token_ids(
            ids,
            self.vocab_size,
            f"dataset.remote: a row of the shards {self.where}",
            "Shard the records again (`accel-data shard dataset=sft ... overwrite=true`).",
        )
        x = torch.from_numpy(ids)
        y = torch.from_numpy(np.asarray(item["labels"], dtype=np.int64))
        if self.written != self.ignore:  # token ids are >= 0, both labels < 0
            y[y == self.written] = self.ignore
        if "position_ids" not in item:
            return x, y
        pos = torch.from_numpy(np.asarray(item["position_ids"], dtype=np.int64))
        return {"input_ids": x, "position_ids": pos}, y


def build_streaming_sft(
    *,
    remote: str,
    tokenizer: str | None = None,
    local: str | None = None,
    cache_limit: Any = "20gb",
    ignore_index: int = -100,
    max_length: int | None = None,
    pack: bool | None = None,
    chat_template: str | None = None,
    **_,
) -> Splits:
    """The `dataset=streaming_sft` splits (see the module docstring)."""
    remote, meta, cache, limit = open_shard_set(remote, local, cache_limit, "sft")
    info = meta["sft"]
    _note_row_shape(remote, info, max_length, pack)
    if tokenizer:
        _check_tokenizer(remote, info, str(tokenizer), chat_template)
    vocab_size = int(info["vocab_size"])
    splits = {}
    for name in ("train", "val", "test"):
        samples = int((meta["splits"].get(name) or {}).get("samples") or 0)
        if not samples:
            continue
        check_shards(remote, name, samples)
        where = f"{remote.rstrip('/')}/{name}"
        row = _Row(vocab_size, where, int(info["ignore_index"]), int(ignore_index))
        source = StreamingSource(remote, name, cache, limit, row)
        cls = StreamingTrainSplit if name == "train" else StreamingEvalSplit
        splits[name] = cls(source, indices=range(samples))
    return window_splits(splits["train"], splits["val"], vocab_size, splits.get("test"))


def _note_row_shape(remote: str, info: dict, max_length, pack) -> None:
    """The rows' length and packing were fixed when the shards were written; a config that
    asks for others (e.g. +experiment=sft_lora's pack=true over unpacked shards) is told so."""
    asked = {"max_length": max_length, "pack": pack}
    differ = [f"dataset.{k}={v}" for k, v in asked.items() if v is not None and v != info[k]]
    if differ:
        log.warning(
            "%s: the rows were written with max_length=%d, pack=%s; %s does not apply to "
            "shards (shard the records again to change it)",
            remote,
            info["max_length"],
            str(info["pack"]).lower(),
            " and ".join(differ),
        )


def _check_tokenizer(remote: str, info: dict, folder: str, template: str | None) -> None:
    """`template`: dataset.chat_template, the one the rows were rendered with (not the
    folder's)."""
    if (
        tokenizer_fingerprint(load_tokenizer(folder, chat_template=template))
        != info["tokenizer_fingerprint"]
    ):
        raise UserError(
            f"dataset.remote={remote} was tokenized with the tokenizer of {info['tokenizer']}, "
            f"and dataset.tokenizer={folder} (model=hf: model.path) holds another one (its "
            "vocabulary, special tokens or chat template differ), so the model would read "
            "the rows' ids as other tokens. Train the model the rows were made for, or shard "
            f"the records again with `accel-data shard dataset=sft dataset.tokenizer={folder} "
            "... overwrite=true`."
        )
