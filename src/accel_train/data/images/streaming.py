"""`dataset=streaming`: image shards written by `accel-data shard`, read through LitData's
StreamingDataset from a local folder or an object store (`s3://`, any S3-compatible endpoint),
through a bounded local cache.

A shard set (docs/streaming.md) is LitData's own format, one LitData data set per split, plus
one small file of ours that lists the classes and labels:

    <remote>/accel_train.index.json     classes, and each split's sample count and labels
    <remote>/train/index.json, chunk-*.bin    LitData (each item: index, encoded image, label)
    <remote>/val/...  <remote>/test/...

Training reads the train split with LitData's StreamingDataLoader: LitData shuffles chunks and
the items inside them by (seed, epoch), gives each rank and each loader worker its own chunks,
downloads ahead and evicts used chunks once the cache would pass `cache_limit`. The position in
an epoch is the loop's `batch_in_epoch`; data/shards/reader.py's StreamingLoader turns it into
the state LitData resumes from, so a resumed run reads exactly the samples the epoch had left.
Validation and test (small) are read by index in order, through the usual torch loader.

Images are decoded and cropped by data/images/decode.py's code at full size (or, with
augment=device, into data/images/folder.py's base images), so `dataset=streaming` and
`dataset=image_folder` of the same files give the same pixels.

This module holds only what is particular to images (the decoder and the splits' options). The
shard set's index and checks are in data/shards/shard_set.py, the S3 access in
data/shards/object_store.py, and the LitData source, splits and loader in data/shards/reader.py:
token shards (`dataset=streaming_tokens`) and instruction rows (`dataset=streaming_sft`) use them as
well; the index's `kind` keeps each option to its own kind of shards.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from accel_train.data.crops import DeviceRandomResizedCrop, RandomResizedCrop, eval_resize_to
from accel_train.data.images.decode import decode_eval, decode_train
from accel_train.data.images.folder import check_options, decode_base_image
from accel_train.data.shards.reader import StreamingEvalSplit, StreamingSource, StreamingTrainSplit
from accel_train.data.shards.shard_set import SPLITS, check_shards, open_shard_set
from accel_train.data.splits import Splits
from accel_train.errors import UserError


class _Decoder:
    """An item of the shards -> (uint8 image, label), as dataset=image_folder makes it: a
    random resized crop of the whole photo (``crop`` given), the evaluation resize and center
    crop (``view="center"``), or the base image (``view="base"``, for augment=device)."""

    def __init__(self, size, resize_to, view, crop, seed, where, mode):
        self.size, self.resize_to, self.view = size, resize_to, view
        self.crop, self.seed, self.where, self.mode = crop, seed, where, mode

    def __call__(self, item: dict, epoch: int) -> tuple[torch.Tensor, int]:
        index = int(item["index"])
        data = bytes(item["image"])
        what = f"dataset.remote: sample {index} of the shards {self.where}"
        if self.view == "random":
            rng = random.Random(f"{self.seed}/{epoch}/{index}")
            image = decode_train(data, what, self.crop, self.size, rng)
        elif self.view == "center":
            image = decode_eval(data, what, self.size, self.resize_to, self.mode)
        else:
            encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            image = decode_base_image(encoded, self.resize_to, what)
        return image, int(item["label"])


def build_streaming(
    *,
    remote: str,
    local: str | None = None,
    cache_limit: Any = "20gb",
    seed: int = 0,
    image_size: int = 64,
    eval_image_size: int | None = None,
    crop_pct: float = 0.875,
    interpolation: str = "bilinear",
    resize_size: int = 0,
    augment: str = "cpu",
    crop_scale: Sequence[float] = (0.08, 1.0),
    random_hflip: bool = True,
    num_classes: int | None = None,
    **_,
) -> Splits:
    """The `dataset=streaming` splits (see the module docstring)."""
    scale = check_options(
        image_size, resize_size, augment, "none", 0.0, crop_scale,
        eval_image_size=eval_image_size, crop_pct=crop_pct, interpolation=interpolation,
    )  # fmt: skip
    remote, meta, cache, limit = open_shard_set(remote, local, cache_limit, "image_folder")
    size, eval_size = int(image_size), int(eval_image_size or image_size)
    resize_to = int(resize_size) or eval_resize_to(eval_size, crop_pct)
    crop = RandomResizedCrop(size, scale, random_hflip, interpolation) if augment == "cpu" else None
    train_view = {"cpu": "random", "device": "base", "none": "center"}[augment]
    splits = {}
    for name in SPLITS:
        info = meta["splits"].get(name)
        if not info or not info.get("samples"):
            splits[name] = None
            continue
        check_shards(remote, name, int(info["samples"]))
        view = train_view if name == "train" else "center"
        where = f"{remote.rstrip('/')}/{name}"
        shown = size if name == "train" else eval_size
        decoder = _Decoder(shown, resize_to, view, crop, seed, where, interpolation)
        source = StreamingSource(remote, name, cache, limit, decoder)
        labels = torch.tensor(info["labels"], dtype=torch.int64)
        cls = StreamingTrainSplit if name == "train" else StreamingEvalSplit
        splits[name] = cls(source, labels)
    if splits["val"] is None:
        raise UserError(
            f"dataset.remote={remote}: the shard set has no val split. Write it with a "
            "validation share: `accel-data shard ... dataset.val_fraction=0.1`."
        )
    device_augment = (
        DeviceRandomResizedCrop(size, scale, random_hflip) if augment == "device" else None
    )
    return Splits(
        splits["train"],
        splits["val"],
        splits["test"],
        in_channels=3,
        image_size=size,
        num_classes=int(num_classes or len(meta["classes"])),
        device_augment=device_augment,
    )
