"""`dataset=streaming_preference`: preference pairs written by `accel-data shard
dataset=preference`, streamed with LitData from a local folder or an object store through
dataset=streaming's bounded cache (order, rank and worker split, cache, exact mid-epoch resume).

The pairs are tokenized, rendered and cut once, when the shard set is written, by
data/text/preference.py exactly as `dataset=preference` does; a shard item is one pair: its chosen
and rejected rows (`input_ids`, `labels`: 2 x T, stored flat, int32) and its `index`. The index
keeps the tokenizer's fingerprint: a model folder whose tokenizer differs is refused before the
first step. `task.precompute_reference` needs `dataset=preference` (the whole set at hand).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from accel_train.data.shards.reader import StreamingEvalSplit, StreamingSource, StreamingTrainSplit
from accel_train.data.shards.shard_set import check_shards, open_shard_set
from accel_train.data.splits import Splits
from accel_train.data.text.preference import PadPairs
from accel_train.data.text.sft import tokenizer_fingerprint
from accel_train.data.text.tokens import check_token_ids
from accel_train.errors import UserError
from accel_train.models.hf import load_tokenizer

log = logging.getLogger("accel_train")


def pair_item(item: dict[str, torch.Tensor]) -> dict:
    """One shard item from a `dataset=preference` pair (LitData's optimize calls this in its
    writer processes): the rows flat, int32."""
    return {
        "input_ids": item["input_ids"].reshape(-1).to(torch.int32).numpy(),
        "labels": item["labels"].reshape(-1).to(torch.int32).numpy(),
        "index": int(item["index"]),
    }


class _Pair:
    """A shard item -> the item `dataset=preference` gives; ids checked against the
    vocabulary, the label of unscored tokens the shards were written with made the task's."""

    def __init__(self, vocab_size: int, where: str, written: int, ignore: int):
        self.vocab_size, self.where = vocab_size, where
        self.written, self.ignore = written, ignore

    def __call__(self, item: dict, epoch: int) -> dict[str, torch.Tensor]:
        ids = np.asarray(item["input_ids"], dtype=np.int64)
        check_token_ids(
            ids,
            self.vocab_size,
            f"dataset.remote: a pair of the shards {self.where}",
            "Shard the pairs again (`accel-data shard dataset=preference ... overwrite=true`).",
        )
        y = torch.from_numpy(np.asarray(item["labels"], dtype=np.int64)).view(2, -1)
        if self.written != self.ignore:  # token ids are >= 0, both labels < 0
            y[y == self.written] = self.ignore
        x = torch.from_numpy(ids).view(2, -1)
        return {"input_ids": x, "labels": y, "index": torch.tensor(int(item["index"]))}


def build_streaming_preference(
    *,
    remote: str,
    tokenizer: str | None = None,
    local: str | None = None,
    cache_limit: Any = "20gb",
    ignore_index: int = -100,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    chat_template: str | None = None,
    **_,
) -> Splits:
    """The `dataset=streaming_preference` splits (see the module docstring)."""
    remote, meta, cache, limit = open_shard_set(remote, local, cache_limit, "preference")
    info = meta["preference"]
    asked = {"max_length": max_length, "max_prompt_length": max_prompt_length}
    differ = [f"dataset.{k}={v}" for k, v in asked.items() if v is not None and v != info[k]]
    if differ:  # (e.g. +experiment=dpo_lora's lengths over shards cut otherwise)
        log.warning(
            "%s: the pairs were cut at max_length=%s, max_prompt_length=%s when sharded; %s "
            "does not apply to shards (shard the pairs again to change it)",
            remote, info["max_length"], info["max_prompt_length"], " and ".join(differ),
        )  # fmt: skip
    # (dataset.chat_template: the template the pairs were rendered with, when not the folder's)
    tok = load_tokenizer(str(tokenizer), chat_template=chat_template) if tokenizer else None
    if tok is not None and tokenizer_fingerprint(tok) != info["fingerprint"]:
        raise UserError(
            f"dataset.remote={remote} was tokenized with the tokenizer of {info['tokenizer']}, "
            f"and dataset.tokenizer={tokenizer} (model=hf: model.path) holds another one, so "
            "the model would read the pairs' ids as other tokens. Train the model the pairs "
            "were made for, or shard them again with `accel-data shard dataset=preference "
            f"dataset.tokenizer={tokenizer} ... overwrite=true`."
        )
    vocab_size = int(info["vocab_size"])
    splits = {}
    for name in ("train", "val", "test"):
        samples = int((meta["splits"].get(name) or {}).get("samples") or 0)
        if not samples:
            continue
        check_shards(remote, name, samples)
        where = f"{remote.rstrip('/')}/{name}"
        pair = _Pair(vocab_size, where, int(info["ignore_index"]), int(ignore_index))
        cls = StreamingTrainSplit if name == "train" else StreamingEvalSplit
        split = cls(StreamingSource(remote, name, cache, limit, pair), indices=range(samples))
        split.collate = PadPairs(int(info["pad_id"]), int(ignore_index))
        splits[name] = split
    shape = {"in_channels": 0, "image_size": 0, "num_classes": 0}
    return Splits(
        splits["train"],
        splits["val"],
        splits.get("test"),
        **shape,
        model_args={"vocab_size": vocab_size},
        only_task="preference",
    )
