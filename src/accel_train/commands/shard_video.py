"""`accel-data shard dataset=video_folder`: a video folder (or list) -> a LitData shard set that
`dataset=streaming_video` trains from (data/video/streaming.py), written by commands/shard.py's
writer, with its `overwrite` rules (nothing but a shard set this command wrote is replaced).

The splits are the ones `dataset=video_folder` would train on, built by it: the same files,
labels, segments (a list's start/end) and held-out share, and its header check (every file's
metadata read once; unreadable, empty and audio-only files refused together, before
anything is written; not the clip length: a shard stores whole videos). Each item is one video:

    index, label        the position in its split (the seed of its clips) and the class
    video               the file's bytes as they are, or re-encoded (below)
    fps, height, width  the stored video's frame rate and size
    first, last         the clip window in its frames: a list row's segment, else all of it

accel_train.index.json also lists each split's rates, windows and sizes, so that the streaming
option checks every clip fits before reading a chunk.

With `max_side=N` (frames whose longer side is above N are resized to N, antialiased),
`min_side=N` (the shorter side, as torchvision's reference resizes: 16:9 and 4:3 keep the same
short side; a size that leaves re-encoded frames below `dataset.image_size` is refused) or
`fps=F` (videos above F frames per second keep one frame every source_fps / F, as
`dataset.fps` samples clips), a video is decoded by torchcodec (only its window) and encoded
again by torchcodec's encoder (FFmpeg's libx264, CRF `crf`, even frame sizes as yuv420p needs):
smaller shards and cheaper decoding, for sets trained at a known size and rate. A video that
needs neither (already small and slow enough, and whole) keeps its bytes: no second generation.
A kept video's window stays in the item (its bytes are the whole file); a re-encoded one is cut to
it. torchcodec's encoder takes the whole video at once, so a re-encoded video is held in memory
at its new size (10 s of 171x128 at 15 fps: 10 MB).

`gop=N` puts a key frame at least every N frames of a re-encoded video, and also re-encodes (at
its size and rate) a video that would be kept but whose key frames are further apart (its packets
are read once, by PyAV, no decoding). A clip is decoded from the key frame before its first frame,
so at libx264's default of 250 frames (8 s at 30 fps) seeking saves little over decoding from the
start; at 32 a 16-frame clip decodes at most 31 frames more than it shows. The price is size: key
frames cost several times a predicted frame (scripts/bench/video_loader.py --gop measures it).
Unset, re-encoded videos get DEFAULT_GOP and kept ones keep their bytes; `gop=0` keeps libx264's
default and every kept video's bytes.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from accel_train.data.build import build_splits
from accel_train.data.video.clips import resize_frames
from accel_train.data.video.decode import decode_clip, video_metadata
from accel_train.data.video.folder import list_classes, read_list
from accel_train.errors import UserError

log = logging.getLogger("accel_train")

DEFAULT_CRF = 23  # libx264's own default
# the key frame interval of re-encoded videos when `gop` is unset: a 16-frame clip decodes at most
# 31 frames it does not show; the bench's clips: 1.8x the bytes, 1.9x the clips/s of libx264's 250
DEFAULT_GOP = 32


def plan(
    entry: tuple,
    max_side: int,
    fps: float,
    gop: int | None = None,
    gap: int = 0,
    min_side: int = 0,
) -> dict:
    """What is stored of one video: ``entry`` is (index, path, label, first, last, fps, height,
    width) as dataset=video_folder reads it, ``gap`` the most frames between its key frames
    (read only when ``gop`` > 0); the result names the source frames to re-encode (``frames``,
    empty: the bytes as they are) and the stored video's shape. ``max_side`` caps the longer
    side, ``min_side`` the shorter one (torchvision's reference resizes the short side: a 16:9
    video keeps that side whatever its width)."""
    index, path, label, first, last, rate, height, width = entry
    size = (height, width)
    side = max(height, width) if max_side > 0 else min(height, width)
    cap = max_side if max_side > 0 else min_side
    if cap > 0 and side > cap:
        scale = cap / side
        size = (max(2, round(height * scale / 2) * 2), max(2, round(width * scale / 2) * 2))
    faster = bool(fps) and rate > fps + 1e-6
    out = {"index": int(index), "path": path, "label": int(label), "frames": []}
    sparse = bool(gop) and gap > gop  # (gop None or 0: never re-encoded for it)
    if size == (height, width) and not faster and not sparse:
        return {
            **out,
            "fps": float(rate),
            "height": height,
            "width": width,
            "window": (first, last),
        }
    step = rate / fps if faster else 1.0
    frames = [first + math.floor(k * step) for k in range(math.ceil((last - first) / step))]
    frames = [f for f in frames if f < last]
    h, w = size[0] - size[0] % 2, size[1] - size[1] % 2  # (yuv420p: an odd source size too)
    shown = float(fps) if faster else float(rate)
    return {**out, "frames": frames, "fps": shown, "height": h, "width": w,
            "window": (0, len(frames))}  # fmt: skip


class ReadVideo:
    """One shard item from its :func:`plan` (LitData's optimize calls it in its writer
    processes): the fields of the module docstring."""

    def __init__(self, crf: int = DEFAULT_CRF, gop: int = DEFAULT_GOP):
        self.crf, self.gop = crf, gop  # (gop 0: libx264's default)

    def __call__(self, planned: dict) -> dict:
        path, frames = planned["path"], planned["frames"]
        if frames:
            data = self._encoded(planned)
        else:
            with open(path, "rb") as f:
                data = f.read()
        first, last = planned["window"]
        return {
            "index": planned["index"], "label": planned["label"], "video": data,
            "fps": planned["fps"], "height": planned["height"], "width": planned["width"],
            "first": int(first), "last": int(last),
        }  # fmt: skip

    def _encoded(self, planned: dict) -> bytes:
        path, frames = planned["path"], planned["frames"]
        h, w = planned["height"], planned["width"]
        chunks = [  # (one chunk of 64 frames at full size at a time)
            resize_frames(decode_clip(path, frames[k : k + 64]), h, w)
            for k in range(0, len(frames), 64)
        ]
        data = _encode(torch.cat(chunks), planned["fps"], self.crf, self.gop, path)
        got = video_metadata(data)
        if (got.num_frames, got.height, got.width) != (len(frames), h, w):
            raise UserError(
                f"dataset.root: re-encoding {path} gave {got.num_frames} frames of "
                f"{got.width}x{got.height}, not the {len(frames)} of {w}x{h} given: the FFmpeg "
                "encoder changed them. Shard the videos as they are (max_side=0 fps=0)."
            )
        return data


def _encode(frames, rate: float, crf: int, gop: int, path: str) -> bytes:
    """uint8 (T, C, H, W) -> the bytes of an H.264 MP4 (torchcodec's encoder), a key frame at
    least every ``gop`` frames (FFmpeg's ``g``; 0: libx264's default)."""
    from torchcodec.encoders import VideoEncoder

    extra = {"g": str(gop)} if gop > 0 else None
    try:
        encoded = VideoEncoder(frames, frame_rate=rate).to_tensor(
            "mp4", codec="libx264", pixel_format="yuv420p", crf=crf, extra_options=extra
        )
    except (RuntimeError, ValueError) as err:
        raise UserError(
            f"dataset.root: re-encoding {path} failed ({' '.join(str(err).split())[:300]}). "
            "torchcodec encodes with FFmpeg's libx264: install an FFmpeg built with it "
            "(`apt-get install ffmpeg`), or shard the videos as they are (max_side=0 fps=0)."
        ) from None
    return encoded.numpy().tobytes()


def check_video_options(cfg: DictConfig, smallest: int) -> tuple[int, float, int, int | None]:
    """(max_side, fps, crf, gop), every problem in one paragraph (`min_side`: video_sides)."""
    max_side, fps, crf = int(cfg.max_side), float(cfg.get("fps") or 0), int(cfg.get("crf", 23))
    min_side = int(cfg.get("min_side") or 0)
    gop = None if cfg.get("gop") is None else int(cfg.gop)
    problems = []
    if max_side < 0 or 0 < max_side < smallest:
        problems.append(
            f"max_side={max_side}: the longest frame side in pixels videos are shrunk to, at "
            f"least {smallest} (0 keeps them as they are), e.g. `min_side=128` instead"
        )
    if min_side < 0 or 0 < min_side < smallest:
        problems.append(
            f"min_side={min_side}: the shorter frame side in pixels videos are shrunk to, at "
            f"least {smallest} (0 keeps them as they are), e.g. `min_side=128`"
        )
    if max_side and min_side:
        problems.append(
            f"max_side={max_side} and min_side={min_side}: give one (min_side, the shorter "
            "side, as torchvision's reference resizes)"
        )
    if fps < 0:
        problems.append(f"fps={fps:g}: the frame rate to keep, > 0 (0 keeps every frame)")
    if not 0 <= crf <= 51:
        problems.append(f"crf={crf}: libx264's constant rate factor, 0-51 (23: its default)")
    if gop is not None and gop < 0:
        problems.append(
            f"gop={gop}: the most frames between key frames, > 0 (0: libx264's default), e.g. "
            "`gop=32`"
        )
    if problems:
        raise UserError(f"accel-data shard dataset=video_folder: {'; '.join(problems)}.")
    return max_side, fps, crf, gop


def keyframe_gap(path: str) -> int:
    """The most frames from one key frame to the next (or to the end) in ``path``'s video
    stream: its packets read by PyAV, none decoded."""
    import av

    with av.open(path) as container:
        stream = container.streams.video[0]
        packets = [(p.pts, p.is_keyframe) for p in container.demux(stream) if p.pts is not None]
    keys = [i for i, (_, key) in enumerate(sorted(packets)) if key]  # (presentation order)
    if not keys:
        return len(packets)
    return max(b - a for a, b in zip(keys, [*keys[1:], len(packets)]))


def video_parts(
    cfg: DictConfig, max_side: int, fps: float, gop: int | None = None, min_side: int = 0
) -> tuple[dict, dict, list[str]]:
    """The splits dataset=video_folder trains on, as shard inputs: (split -> the items' plans,
    split -> its entry of accel_train.index.json, the class names)."""
    # The folder's rules and its header check, less the clip length: a shard set stores whole
    # videos, and the clip is chosen when training from it (dataset=streaming_video checks
    # the stored windows against its clip before a chunk is read).
    # (and one entry a video: clips_per_video repeats videos for training only)
    dataset = OmegaConf.merge(cfg.dataset, {"pad_short": True, "clips_per_video": 1})
    splits = build_splits(dataset, ".")
    inputs, info = {}, {}
    for name in ("train", "val", "test"):
        split = getattr(splits, name)
        if split is None:
            continue
        plans = []
        for i in range(len(split)):
            first, last = (int(b) for b in split.bounds[i])
            height, width = (int(v) for v in split.shape[i])
            entry = (i, split.path(i), int(split.labels[i]), first, last, float(split.fps[i]),
                     height, width)  # fmt: skip
            gap = keyframe_gap(split.path(i)) if gop else 0
            plans.append(plan(entry, max_side, fps, gop, gap, min_side))
        inputs[name] = plans
        info[name] = {
            "samples": len(plans),
            "labels": [p["label"] for p in plans],
            # the clip windows and rates: the streaming option checks clips fit without a chunk
            "fps": [p["fps"] for p in plans],
            "window": [list(p["window"]) for p in plans],
            "size": [[p["height"], p["width"]] for p in plans],
        }
    return inputs, info, _class_names(cfg, splits.num_classes)


def check_crop(inputs: dict, crop: int, resize: str) -> None:
    """Refuse a resize (`resize`: the key given) that leaves re-encoded frames smaller than the
    crop training takes (`dataset.image_size`): every such video would be upsampled again, or
    refused, at training. Videos kept as they are are not this command's to refuse."""
    small = [(name, p) for name, plans in inputs.items() for p in plans
             if p["frames"] and min(p["height"], p["width"]) < crop]  # fmt: skip
    if not small:
        return
    name, first = small[0]
    raise UserError(
        f"accel-data shard {resize}: {len(small)} video(s) would be stored smaller than "
        f"dataset.image_size={crop}, the crop training takes (e.g. {first['path']} in {name} at "
        f"{first['width']}x{first['height']}): a wide video's longer side capped leaves its "
        f"shorter side below the crop. Shard by the shorter side, `min_side={max(crop, 128)}` "
        "(torchvision's reference resizes it to 128 for 112 crops), or set dataset.image_size "
        "to your recipe's crop. Nothing was written."
    )


def _class_names(cfg: DictConfig, n: int) -> list[str]:
    """The class names as dataset=video_folder orders them: its class folders, or a list's
    labels (names, or indices already)."""
    ds = cfg.dataset
    if ds.get("list_file"):
        names = list_classes(read_list(str(ds.list_file), "dataset.list_file"))
    else:
        folder = Path(str(ds.root)).expanduser() / str(ds.get("train_split") or "train")
        names = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    return names if len(names) == n else [str(i) for i in range(n)]
