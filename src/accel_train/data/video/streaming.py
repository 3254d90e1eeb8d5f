"""`dataset=streaming_video`: video shards written by `accel-data shard dataset=video_folder`
(commands/shard_video.py), read through LitData from a local folder or an object store, as
`dataset=streaming` reads image shards (data/shards/reader.py: the source, the splits, the
training loader with its exact mid-epoch resume).

Each item holds one video's bytes, its label, its frame rate and size and its clip window, so a
clip is drawn and decoded exactly as `dataset=video_folder` draws it from the file
(data/video/folder.py: ``random.Random(seed/epoch/index)`` for the window, the crop box and
the flip; ``eval_clips`` x ``eval_crops`` views at evaluation, their scores averaged per
video), decoding only the clip's frames from the bytes with torchcodec
(data/video/decode.py). Shards of videos kept as they are give the same clips as the folder,
sample for sample; re-encoded ones (`max_side`, `fps`) the same windows of the new frames.

The shard set's index lists every video's rate and window, so clips that do not fit (fewer
frames than a clip spans, without ``pad_short``) are refused before a chunk is read, naming
the samples. ``decode=gpu`` is refused: the bytes are decoded in the loader workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from accel_train.data.crops import RandomResizedCrop, ResizedRandomCrop
from accel_train.data.shards.reader import StreamingEvalSplit, StreamingSource, StreamingTrainSplit
from accel_train.data.shards.shard_set import SPLITS, check_shards, open_shard_set
from accel_train.data.splits import Splits
from accel_train.data.video.clips import Timing
from accel_train.data.video.folder import (
    ClipPlan,
    check_options,
    clip_timing,
    draw_clips,
    train_crop,
)
from accel_train.errors import UserError

SHOWN = 5  # samples named in a refusal


class ClipDecoder:
    """A shard item -> (uint8 clip (C, T, S, S) or views (V, C, T, S, S), label), drawn as
    data/video/folder.py's VideoClipSplit.getitem draws it (``crop`` given: training)."""

    def __init__(
        self,
        timing: Timing,
        size: int,
        resize_to: int,
        seed: int,
        threads: int,
        shuffle_frames: bool,
        crop: RandomResizedCrop | ResizedRandomCrop | None,
        clips: int,
        crops: int,
    ):
        self.timing, self.size, self.resize_to, self.seed = timing, size, resize_to, seed
        self.threads, self.shuffle_frames, self.crop = threads, shuffle_frames, crop
        self.clips, self.crops = clips, crops

    def __call__(self, item: dict, epoch: int) -> tuple[torch.Tensor, int]:
        i, fps = int(item["index"]), float(item["fps"])
        first, last = int(item["first"]), int(item["last"])
        height, width = int(item["height"]), int(item["width"])
        clips, box = draw_clips(self, i, epoch, first, last, fps, height, width)
        plan = ClipPlan(bytes(item["video"]), clips, box, self.size, self.resize_to, self.crops,
                        self.threads)  # fmt: skip
        return plan.decode_on(torch.device("cpu")), int(item["label"])


def check_windows(meta: dict, timing: Timing, pad_short: bool, remote: str) -> None:
    """Every video's window holds a clip (or, with pad_short, a frame): from the index."""
    short = []
    for name, info in meta["splits"].items():
        for i, ((first, last), fps) in enumerate(zip(info["window"], info["fps"], strict=True)):
            need = 1 if pad_short else timing.span(float(fps))
            if last - first < need:
                short.append(f"{name} sample {i} ({last - first} frames)")
    if short:
        more = f" and {len(short) - SHOWN} more" if len(short) > SHOWN else ""
        spacing = f"fps={timing.fps:g}" if timing.fps else f"frame_stride={timing.stride}"
        raise UserError(
            f"dataset.remote={remote}: {len(short)} video(s) of the shards are shorter than a "
            f"clip: {', '.join(short[:SHOWN])}{more}. A clip spans (frames - 1) x step + 1 "
            f"frames (dataset.frames={timing.frames}, dataset.{spacing}; the shards' rate: "
            "accel-data shard fps=): lower them, or set `dataset.pad_short=true` to repeat "
            "frames of short videos."
        )


def build_streaming_video(
    *,
    remote: str,
    local: str | None = None,
    cache_limit: Any = "20gb",
    seed: int = 0,
    frames: int = 16,
    frame_stride: int | None = None,
    fps: float | None = 15,
    image_size: int = 112,
    resize_size: int = 128,
    train_resize: Sequence[int] | None = None,
    crop_scale: Sequence[float] | None = None,
    random_hflip: bool = True,
    eval_clips: int = 5,
    eval_crops: int = 1,
    decode_threads: int = 1,
    decode: str = "cpu",
    pad_short: bool = False,
    shuffle_frames: bool = False,
    num_classes: int | None = None,
    **_,
) -> Splits:
    """The `dataset=streaming_video` splits (see the module docstring).

    Long because its signature lists every key of the option, one a line (the builder's
    keyword arguments)."""
    check_options(frames, frame_stride, fps, image_size, resize_size, eval_clips, eval_crops,
                  decode_threads, decode)  # fmt: skip
    crop = train_crop(image_size, resize_size, train_resize, crop_scale, random_hflip)
    if decode != "cpu":
        raise UserError(
            "dataset.decode=gpu with dataset=streaming_video: the shards' videos are decoded "
            "in the loader workers (FFmpeg on the CPU). Set `dataset.decode=cpu`, or train "
            "from the files with `dataset=video_folder dataset.decode=gpu`."
        )
    remote, meta, cache, limit = open_shard_set(remote, local, cache_limit, "video_folder")
    timing = clip_timing(frames, frame_stride, fps)
    check_windows(meta, timing, bool(pad_short), remote)
    common = dict(timing=timing, size=int(image_size), resize_to=int(resize_size), seed=seed,
                  threads=int(decode_threads), shuffle_frames=bool(shuffle_frames))  # fmt: skip
    splits = {}
    for name in SPLITS:
        info = meta["splits"].get(name)
        if not info or not info.get("samples"):
            splits[name] = None
            continue
        check_shards(remote, name, int(info["samples"]))
        train = name == "train"
        decoder = ClipDecoder(**common, crop=crop if train else None, clips=int(eval_clips),
                              crops=int(eval_crops))  # fmt: skip
        source = StreamingSource(remote, name, cache, limit, decoder)
        labels = torch.tensor(info["labels"], dtype=torch.int64)
        splits[name] = (StreamingTrainSplit if train else StreamingEvalSplit)(source, labels)
        if not train:  # (the device batch at evaluation: said at start-up, as the folder's)
            splits[name].views = int(eval_clips) * int(eval_crops)
            splits[
                name
            ].views_from = f"dataset.eval_clips={eval_clips} x dataset.eval_crops={eval_crops}"
    if splits["val"] is None:
        raise UserError(
            f"dataset.remote={remote}: the shard set has no val split. Write it with a "
            "validation share: `accel-data shard dataset=video_folder ... "
            "dataset.val_fraction=0.1`."
        )
    return Splits(
        splits["train"],
        splits["val"],
        splits["test"],
        in_channels=3,
        image_size=int(image_size),
        num_classes=int(num_classes or len(meta["classes"])),
    )  # (no `frames` in model_args, as dataset=video_folder: **kwargs builders pass it on)
