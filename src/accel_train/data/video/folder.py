"""`dataset=video_folder`: video files in class folders, or a list of them (Kinetics-style).

    <root>/<train_split>/<class>/*.mp4|webm|mkv|avi   training videos
    <root>/<val_split>/<class>/...     validation videos; absent: held out of train (image_folder's
    <root>/<test_split>/<class>/...    rule, data/folder_tree.py)  optional test split

or ``list_file`` (and ``val_list_file``, ``test_list_file``): CSV rows ``path,label[,start,end]``
(a first row ``path,label,...`` is a header) or JSONL objects with those keys; paths relative to
``root``, labels class names (sorted into indices; labels that are all integers are the indices
themselves), ``start``/``end`` in seconds (the annotated segment; empty: the whole video).

Every file's metadata (frames, fps, duration, size) is read once, in the launching process, by
torchcodec's exact scan (data/video/decode.py), and kept in the splits (which the loader workers
and Ray actors receive). Between runs it is kept in ``dataset.metadata_cache``, outside the data
folder (data/video/metadata_cache.py): a later run reads only the files added or changed since,
and nothing is ever written into the data folder. That read is the header check: empty,
unreadable, audio-only and too-short files (fewer frames than a clip spans, unless
``pad_short``) are refused together, in one paragraph naming them, before anything is trained or
written (the cache keeps only the good files, so a refused one is read again next run).

Items are uint8 and stay so until the device (data/transform.py normalises them). Training:
``(C, T, S, S)``, a random clip with one random resized crop and flip for all its frames, drawn
from ``random.Random(seed/epoch/index)`` like the image folders' crops, so the batches do not
depend on the number of workers or on a resume. Evaluation: ``(V, C, T, S, S)`` with
``V = eval_clips * eval_crops`` views (data/video/clips.py); the classification task averages
the views' scores per video (video accuracy). ``shuffle_frames`` is an ablation: it permutes
each clip's frames, so only what single frames show is left to learn.

``decode=gpu``: the workers draw the same frames and boxes (from the cached metadata) without
decoding; the device transform decodes each clip with torchcodec's CUDA decoder (NVDEC) and
crops it there (:class:`ClipBatch`).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from accel_train.data.crops import RandomResizedCrop, ResizedRandomCrop
from accel_train.data.folder_tree import FileKind, plan_layout
from accel_train.data.splits import Splits, held_out_indices
from accel_train.data.video.clips import Timing, eval_views, train_view
from accel_train.data.video.decode import (
    VideoMeta,
    VideoReadError,
    check_decoder,
    decode_clip,
    video_metadata,
)
from accel_train.data.video.metadata_cache import MetadataCache, cache_file
from accel_train.errors import UserError

log = logging.getLogger(__name__)

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".avi", ".mov", ".m4v")
VIDEOS = FileKind("video_folder", "videos", VIDEO_EXTENSIONS, "dataset=video_folder")
DECODES = ("cpu", "gpu")
SHOWN = 5  # files named per kind of problem in the header check's paragraph
# Metadata of at least this many files is read by worker processes (fewer: in-process).
PARALLEL_READ_MIN = 256


@dataclass
class VideoList:
    """One source of videos: absolute paths, class indices, segments in seconds (NaN: none)."""

    paths: list[str]
    labels: torch.Tensor
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)

    def __post_init__(self):
        nan = [float("nan")] * len(self.paths)
        self.start, self.end = self.start or list(nan), self.end or list(nan)


def build_video_folder(
    *,
    root: str,
    list_file: str | None = None,
    val_list_file: str | None = None,
    test_list_file: str | None = None,
    train_split: str = "train",
    val_split: str | None = "val",
    test_split: str | None = "test",
    holdout: bool = False,
    val_fraction: float = 0.1,
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
    clips_per_video: int = 1,
    decode_threads: int = 1,
    decode: str = "cpu",
    pad_short: bool = False,
    shuffle_frames: bool = False,
    metadata_cache: str | None = None,
) -> Splits:
    """Train / val / test splits of a video folder or list (see the module docstring).

    Long because its signature lists every key of the option, one a line (the builder's
    keyword arguments)."""
    check_options(frames, frame_stride, fps, image_size, resize_size, eval_clips, eval_crops,
                  decode_threads, decode)  # fmt: skip
    crop = train_crop(image_size, resize_size, train_resize, crop_scale, random_hflip)
    root_dir = Path(root).expanduser()
    if not root_dir.is_dir():
        raise UserError(
            f"dataset.root={root!r}: no such folder. Point `dataset.root=/path/to/videos` at the "
            f"folder that holds `{train_split}/<class>/*.mp4` (or the videos a dataset.list_file "
            "names, relative to it)."
        )
    check_decoder()  # FFmpeg's libraries, once, before any file is blamed
    train, val, test, classes = _sources(root_dir, list_file, val_list_file, test_list_file,
                                         train_split, val_split, test_split, holdout,
                                         val_fraction)  # fmt: skip
    timing = clip_timing(frames, frame_stride, fps)
    lists = [x for x in (train, val, test) if x is not None]
    paths = sorted({p for x in lists for p in x.paths})
    cache = MetadataCache(cache_file(metadata_cache, root_dir))
    metas = read_metadata(paths, timing, pad_short, lists, cache)
    common = dict(timing=timing, size=int(image_size), resize_to=int(resize_size), seed=seed,
                  threads=int(decode_threads), decode=decode,
                  shuffle_frames=bool(shuffle_frames))  # fmt: skip
    views = dict(clips=int(eval_clips), crops=int(eval_crops))
    if int(clips_per_video) < 1:
        raise UserError(
            f"dataset.clips_per_video={clips_per_video} must be >= 1: the training clips drawn "
            "from each video an epoch (torchvision's reference: 5)."
        )
    made = _splits(train, val, test, metas, val_fraction, seed, crop, common, views,
                   int(clips_per_video))  # fmt: skip
    return Splits(
        *made,
        in_channels=3,
        image_size=int(image_size),
        # (No `frames` in model_args: builders that take **kwargs, model=torchvision's and
        # timm's, would pass it on to architectures that do not know it.)
        num_classes=len(classes),
        class_names=[str(c) for c in classes],
    )


def _splits(train, val, test, metas, val_fraction, seed, crop, common, views, per_video=1) -> tuple:
    """(train, val, test or None) splits: validation is the val videos, or a stratified,
    seeded val_fraction of the training ones, at least one video a class (hold_out). The
    training split lists each video ``per_video`` times (dataset.clips_per_video): each entry
    draws its own clip (its index seeds the draw), as the reference's RandomClipSampler."""

    def whole(videos: VideoList | None) -> VideoClipSplit | None:
        if videos is None:
            return None
        return VideoClipSplit(videos, metas, torch.arange(len(videos.paths)), **views, **common)

    if val is None:
        train_idx, val_idx = hold_out(train, val_fraction, seed)
        held = VideoClipSplit(train, metas, val_idx, **views, **common)
    else:
        train_idx, held = torch.arange(len(train.paths)), whole(val)
    train_idx = train_idx.repeat(per_video)
    return VideoClipSplit(train, metas, train_idx, crop=crop, **common), held, whole(test)


def hold_out(train: VideoList, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) indices of the training videos: a stratified, seeded ``fraction``
    held out, at least one video of each class that has two (a recipe's 1 % of a small folder
    rounds to none), or a UserError with the numbers when no class has two."""
    n = len(train.paths)
    train_idx, val_idx = held_out_indices(n, fraction, seed, train.labels, min_per_class=1)
    if fraction > 0 and len(val_idx) == 0:
        classes = len(train.labels.unique())
        raise UserError(
            f"dataset.val_fraction={fraction:g} holds out no video: the {n} training video(s) "
            f"in {classes} class(es) have no class with two, and a class gives one video to "
            "validation only when one stays for training. Add videos (two or more a class), or "
            "give validation its own videos: a `dataset.val_split` folder under dataset.root "
            "(or `dataset.val_list_file`)."
        )
    return train_idx, val_idx


def clip_timing(frames: int, frame_stride: int | None, fps: float | None) -> Timing:
    """A clip's frames: ``frame_stride`` source frames apart when it is set, else at ``fps``
    (the default 15, the reference's --frame-rate), else every frame."""
    if frame_stride:
        return Timing(int(frames), int(frame_stride), None)
    return Timing(int(frames), 1, float(fps) if fps else None)


def train_crop(size, resize_size, train_resize, crop_scale, hflip):
    """Training's crop: a random resized crop of ``crop_scale`` of the frame's area when it is
    given, else the video reference's fixed resize (``train_resize``, or resize_size x
    resize_size * 171 / 128) and a random ``size`` crop of it."""
    if crop_scale is not None:
        lo, hi = (float(x) for x in crop_scale) if len(crop_scale) == 2 else (0.0, -1.0)
        if not 0 < lo <= hi <= 1:
            raise UserError(
                f"dataset.crop_scale={list(crop_scale)} must be two numbers 0 < min <= max <= 1: "
                "the random crop's area as a share of the frame, e.g. "
                "`dataset.crop_scale=[0.08,1.0]`, or null for the reference's resize and crop "
                "(dataset.train_resize)."
            )
        return RandomResizedCrop(int(size), (lo, hi), bool(hflip))
    if train_resize is None:
        train_resize = (int(resize_size), round(int(resize_size) * 171 / 128))
    hw = tuple(int(x) for x in train_resize)
    if len(hw) != 2 or min(hw) < int(size):
        raise UserError(
            f"dataset.train_resize={list(train_resize)} must be [height, width], each at least "
            f"dataset.image_size={size}: training resizes every frame to it, then takes a random "
            f"{size} x {size} crop (the reference: [128, 171] for 112). Set "
            f"`dataset.train_resize=[{size},{round(size * 171 / 128)}]` or more."
        )
    return ResizedRandomCrop(int(size), hw, bool(hflip))


def check_options(frames, stride, fps, size, resize_size, clips, crops, threads,
                   decode):  # fmt: skip
    """The options a user can get wrong: one check for `dataset=video_folder` and
    `dataset=streaming_video` (data/video/streaming.py)."""
    for key, value, low in (
        ("frames", frames, 1), ("frame_stride", stride or 1, 1), ("image_size", size, 1),
        ("eval_clips", clips, 1), ("eval_crops", crops, 1), ("decode_threads", threads, 0),
    ):  # fmt: skip
        if value < low:
            raise UserError(
                f"dataset.{key}={value} must be >= {low} (docs/video.md; the dataset option "
                "`dataset=video_folder` lists every key with its meaning)."
            )
    if fps is not None and not fps > 0:
        raise UserError(
            f"dataset.fps={fps} must be > 0 (the frame rate clips are sampled at), or null to "
            "take every frame (or set dataset.frame_stride)."
        )
    if resize_size < size:
        raise UserError(
            f"dataset.resize_size={resize_size} is smaller than dataset.image_size={size}: "
            "evaluation resizes the shorter side to resize_size, then crops image_size. Set "
            f"`dataset.resize_size={size}` or more (torchvision's reference: 128 for 112)."
        )
    if decode not in DECODES:
        raise UserError(
            f"dataset.decode={decode!r} is not one of {', '.join(DECODES)}: `cpu` decodes in "
            "the loader workers (FFmpeg), `gpu` on the CUDA device (NVDEC)."
        )


# ---- where the videos are ------------------------------------------------------------------


def _sources(root, list_file, val_list, test_list, train_split, val_split, test_split, holdout,
             fraction):  # fmt: skip
    """(train, val or None = held out of train, test or None, class names)."""
    if list_file:
        rows = read_list(list_file, "dataset.list_file")
        classes = list_classes(rows)
        train = _as_list(rows, classes, root, "dataset.list_file")
        val = test = None
        if val_list and not holdout:
            val = _as_list(read_list(val_list, "dataset.val_list_file"), classes, root,
                           "dataset.val_list_file")  # fmt: skip
        if test_list:
            test = _as_list(read_list(test_list, "dataset.test_list_file"), classes, root,
                            "dataset.test_list_file")  # fmt: skip
        return train, val, test, classes
    layout = plan_layout(root, train_split, val_split, test_split, holdout, fraction, VIDEOS)

    def of(folder):
        if folder is None:
            return None
        return VideoList([str(folder.path / f) for f in folder.files], folder.labels)

    return of(layout.train), of(layout.val), of(layout.test), layout.train.classes


def read_list(path: str, key: str) -> list[dict]:
    """The rows of a CSV (``path,label[,start,end]``, an optional header) or JSONL list."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{key}={path!r}: no such file. Give a CSV or JSONL list of videos.")
    text = file.read_text(encoding="utf-8")
    rows: list[dict] = []
    if file.suffix.lower() in (".jsonl", ".json"):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(f"{key}={path}: line {n} is not JSON ({err.msg}).") from None
                rows.append(row if isinstance(row, dict) else {})
    else:
        table = [r for r in csv.reader(text.splitlines()) if r and any(c.strip() for c in r)]
        if table and [c.strip().lower() for c in table[0][:2]] == ["path", "label"]:
            table = table[1:]
        names = ("path", "label", "start", "end")
        rows = [{k: v.strip() for k, v in zip(names, r, strict=False)} for r in table]
    for n, row in enumerate(rows, 1):
        if not row.get("path") or row.get("label") in (None, ""):
            raise UserError(
                f"{key}={path}: row {n} has no path or no label. Each row is "
                '`path,label[,start,end]` (CSV) or {"path": ..., "label": ...} (JSONL).'
            )
    if not rows:
        raise UserError(f"{key}={path}: the list is empty. Add rows `path,label[,start,end]`.")
    return rows


def list_classes(rows: list[dict]) -> list[str]:
    """The class names of a list file's rows (read_list): sorted, or the indices themselves when
    every label is an integer; `accel-data shard` names a shard set's classes with it too."""
    labels = {str(r["label"]) for r in rows}
    if all(lab.isdigit() for lab in labels):  # class indices already
        return [str(i) for i in range(max(int(lab) for lab in labels) + 1)]
    return sorted(labels)


def _as_list(rows: list[dict], classes: list[str], root: Path, key: str) -> VideoList:
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted({str(r["label"]) for r in rows} - set(index))
    if unknown:
        raise UserError(
            f"{key}: the labels {', '.join(unknown[:5])} are not labels of dataset.list_file "
            "(the training list, which defines the classes). Fix the labels."
        )

    def seconds(value) -> float:
        return float(value) if value not in (None, "") else float("nan")

    return VideoList(
        [str(root / r["path"]) for r in rows],
        torch.tensor([index[str(r["label"])] for r in rows], dtype=torch.int64),
        [seconds(r.get("start")) for r in rows],
        [seconds(r.get("end")) for r in rows],
    )


# ---- the metadata: read once, the header check ---------------------------------------------


class _Reader(Dataset):
    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        try:
            return video_metadata(self.paths[i])
        except VideoReadError as err:
            return (err.kind, err.what)


def _read_all(paths: list[str]) -> list:
    if len(paths) < PARALLEL_READ_MIN:
        return [_Reader(paths)[i] for i in range(len(paths))]
    from torch.utils.data import DataLoader

    workers = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)
    loader = DataLoader(_Reader(paths), batch_size=None, num_workers=workers,
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    return list(loader)


def read_metadata(
    paths: list[str],
    timing: Timing,
    pad_short: bool,
    lists: list[VideoList],
    cache: MetadataCache | None = None,
) -> dict[str, VideoMeta]:
    """path -> VideoMeta of every video, or one UserError naming every file that cannot give
    a clip: empty, unreadable, audio-only, too short (its window has fewer frames than a clip
    spans; with pad_short only an empty window is). ``cache``: the metadata of earlier runs,
    to which the files read now are added (the good ones, before any refusal)."""
    cache = cache or MetadataCache(None)
    cached = cache.lookup(paths)
    missing = [p for p in paths if p not in cached]
    read = dict(zip(missing, _read_all(missing), strict=True))
    good = {p: m for p, m in read.items() if isinstance(m, VideoMeta) and m.num_frames >= 1}
    cache.store(good)
    source = (
        f"{len(cached)} from the cache at {cache.file}"
        if cache.file
        else "the cache is off: dataset.metadata_cache=null"
    )
    log.info("dataset=video_folder: read the metadata of %d videos (%s)", len(paths), source)
    metas, problems = {}, {"empty": [], "audio-only": [], "unreadable": [], "too short": []}
    for path in paths:
        got = cached[path] if path in cached else read[path]
        if isinstance(got, VideoMeta):
            metas[path] = got
            if got.num_frames < 1:
                problems["unreadable"].append(f"{path} (no frames)")
        else:
            kind, what = got  # (the unreadable ones with FFmpeg's reason)
            problems[kind].append(what if kind == "unreadable" else path)
    seen = set()
    for video in lists:
        for path, start, end in zip(video.paths, video.start, video.end, strict=True):
            meta = metas.get(path)
            if meta is None or (path, start, end) in seen:
                continue
            seen.add((path, start, end))
            first, last = window(meta, start, end)
            need = timing.span(meta.fps) if not pad_short else 1
            if last - first < need:
                segment = "" if np.isnan(start) and np.isnan(end) else f" [{start:g}..{end:g} s]"
                problems["too short"].append(f"{path}{segment} ({last - first} frames)")
    if any(problems.values()):
        raise UserError(_refusal(problems, timing))
    return metas


def _refusal(problems: dict[str, list[str]], timing: Timing) -> str:
    parts = []
    kinds = {"empty": "empty (0 bytes)", "audio-only": "audio only (no video stream)"}
    for kind in ("empty", "audio-only", "unreadable", "too short"):
        what = kinds.get(kind, kind)
        names = problems[kind]
        if names:
            more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
            parts.append(f"{what}: {', '.join(names[:SHOWN])}{more}")
    count = sum(len(v) for v in problems.values())
    fix = ["re-encode or move the unusable files out of dataset.root (or the list)"]
    if problems["too short"]:
        spacing = f"fps={timing.fps:g}" if timing.fps else f"frame_stride={timing.stride}"
        fix.append(
            f"a clip spans (frames - 1) x step + 1 source frames (dataset.frames="
            f"{timing.frames}, dataset.{spacing}): lower them, or set `dataset.pad_short=true` "
            "to repeat frames of short videos"
        )
    return (
        f"dataset=video_folder: {count} video(s) cannot give a clip, checked before anything "
        f"was trained or written: {'; '.join(parts)}. Fix: {'; '.join(fix)}."
    )


def window(meta: VideoMeta, start: float, end: float) -> tuple[int, int]:
    """[first, last) frames of a segment in seconds (NaN: the video's start or end)."""
    first = 0 if np.isnan(start) else max(0, int(start * meta.fps))
    last = meta.num_frames if np.isnan(end) else min(meta.num_frames, int(np.ceil(end * meta.fps)))
    return first, max(first, last)


# ---- the splits ----------------------------------------------------------------------------


class VideoClipSplit(Dataset):
    """Items of some videos of a :class:`VideoList`: training clips ``(uint8 (C, T, S, S),
    label)`` when ``crop`` is given, else evaluation views ``(uint8 (V, C, T, S, S), label)``.
    Everything it holds is arrays (workers are forked, Ray pickles it: module docstring)."""

    def __init__(self, videos: VideoList, metas: dict[str, VideoMeta], indices: torch.Tensor, *,
                 timing: Timing, size: int, resize_to: int, seed: int, threads: int, decode: str,
                 shuffle_frames: bool, crop: RandomResizedCrop | ResizedRandomCrop | None = None,
                 clips: int = 1, crops: int = 1):  # fmt: skip
        idx = indices.tolist()
        self.paths = np.array([os.fsencode(videos.paths[j]) for j in idx])
        self.labels = videos.labels[indices]  # int64 [N]: the labels without decoding
        got = [metas[videos.paths[j]] for j in idx]
        bounds = [window(m, videos.start[j], videos.end[j]) for m, j in zip(got, idx, strict=True)]
        self.bounds = np.array(bounds, dtype=np.int64).reshape(-1, 2)
        self.fps = np.array([m.fps for m in got], dtype=np.float64)
        self.shape = np.array([(m.height, m.width) for m in got], dtype=np.int64).reshape(-1, 2)
        self.timing, self.size, self.resize_to, self.seed = timing, size, resize_to, seed
        self.threads, self.decode, self.shuffle_frames = threads, decode, shuffle_frames
        self.crop, self.clips, self.crops = crop, clips, crops
        # the device batch at evaluation is loader.eval_batch_size x views (said at start-up)
        self.views = 1 if crop is not None else clips * crops
        self.views_from = f"dataset.eval_clips={clips} x dataset.eval_crops={crops}"
        if decode == "gpu":
            self.collate = ClipCollate()

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return self.getitem(i, 0)

    def path(self, i: int) -> str:
        return os.fsdecode(self.paths[i])

    def getitem(self, i: int, epoch: int):
        """The item, its randomness drawn from ``random.Random(seed/epoch/i)`` (training) or
        none (evaluation; the shuffle ablation's order from seed/eval/i)."""
        first, last = (int(b) for b in self.bounds[i])
        height, width = (int(v) for v in self.shape[i])
        clips, box = draw_clips(self, i, epoch, first, last, float(self.fps[i]), height, width)
        plan = ClipPlan(self.path(i), clips, box, self.size, self.resize_to, self.crops,
                        self.threads)  # fmt: skip
        if self.decode == "gpu":
            return plan, int(self.labels[i])
        return plan.decode_on(torch.device("cpu")), int(self.labels[i])

    def __repr__(self) -> str:
        kind = "training clips" if self.crop is not None else f"{self.clips}x{self.crops} views"
        return f"{type(self).__name__}({len(self)} videos, {kind})"


def draw_clips(split, i: int, epoch: int, first: int, last: int, fps: float, height: int,
               width: int) -> tuple[list[list[int]], list[int] | None]:  # fmt: skip
    """The frames of item ``i``'s clips and its training box ``[top, left, h, w, flip]`` (None:
    the evaluation views), drawn from ``random.Random(seed/epoch/i)`` (training; ``split.crop``
    given) or fixed (evaluation; the shuffle ablation's order from seed/eval/i). ``split``: a
    VideoClipSplit or streaming_video's item maker (timing, seed, crop, clips, shuffle_frames)."""
    draw = f"{split.seed}/{epoch}/{i}" if split.crop is not None else f"{split.seed}/eval/{i}"
    if split.crop is not None:
        rng = random.Random(draw)
        clips = [split.timing.train_clip(first, last, fps, rng)]
        top, left, h, w = split.crop.box(height, width, rng)
        box = [top, left, h, w, int(split.crop.hflip and rng.random() < 0.5)]
    else:
        clips, box = split.timing.eval_clips(first, last, fps, split.clips), None
    if split.shuffle_frames:  # the ablation: each clip's frames in a random order
        order = random.Random(f"{draw}/order")
        clips = [order.sample(c, len(c)) for c in clips]
    return clips, box


@dataclass
class ClipPlan:
    """One item's decoding and geometry, drawn in the loader worker: the frames of each clip,
    the training box ``[top, left, h, w, flip]`` (None: the evaluation views)."""

    path: str
    clips: list[list[int]]
    box: list[int] | None
    size: int
    resize_to: int
    crops: int
    threads: int

    def decode_on(self, device: torch.device) -> torch.Tensor:
        """uint8 (C, T, S, S) for training, (V, C, T, S, S) for evaluation, on ``device``
        (a CUDA device decodes with NVDEC)."""
        wanted = sorted({f for clip in self.clips for f in clip})  # each frame decoded once
        where = "cuda" if device.type == "cuda" else "cpu"
        frames = decode_clip(self.path, wanted, threads=self.threads, device=where)
        at = {f: k for k, f in enumerate(wanted)}
        if self.box is not None:
            top, left, h, w, flip = self.box
            clip = frames[[at[f] for f in self.clips[0]]]
            view = train_view(clip[..., top : top + h, left : left + w], self.size, bool(flip))
            return view.permute(1, 0, 2, 3).contiguous()  # (T, C, S, S) -> (C, T, S, S)
        views = [
            eval_views(frames[[at[f] for f in clip]], self.size, self.resize_to, self.crops)
            for clip in self.clips
        ]
        return torch.cat(views).permute(0, 2, 1, 3, 4).contiguous()  # (V, T, C,..) -> (V, C, T,..)


class ClipBatch:
    """``decode=gpu``: a batch of :class:`ClipPlan` (not a tensor: the loader neither pins
    nor moves it); the device transform calls ``decode_on``."""

    def __init__(self, plans: list[ClipPlan]):
        self.plans = plans

    def pin_memory(self) -> ClipBatch:
        return self

    def __len__(self) -> int:
        return len(self.plans)

    def decode_on(self, device: torch.device) -> torch.Tensor:
        return torch.stack([p.decode_on(device) for p in self.plans])


class ClipCollate:
    """``decode=gpu`` items (ClipPlan, label) -> (ClipBatch, int64 labels)."""

    def __call__(self, items: list) -> tuple[ClipBatch, torch.Tensor]:
        labels = torch.tensor([int(y) for _, y in items], dtype=torch.int64)
        return ClipBatch([p for p, _ in items]), labels
