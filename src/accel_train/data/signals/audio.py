"""`dataset=audio_folder`: sound files in class folders, or a CSV list of them.

    <root>/<class>/**/*.wav|flac|mp3|ogg|...   one folder per class (Speech Commands' layout)

Folders whose names start with ``_`` (Speech Commands' ``_background_noise_``) or ``fold``
(UrbanSound8K's ``fold1..fold10``) are not classes: skipped and said in the log. Or
``dataset.list_file``: CSV rows ``path,label`` (a first row ``path,label`` is a header), paths
relative to ``root``.

Any format FFmpeg reads is decoded by torchcodec's ``AudioDecoder`` at ``dataset.sample_rate``
and ``dataset.channels`` (the decoder resamples and mixes down), and only a window's samples are
decoded (``get_samples_played_in_range``). Every file's duration is read once at build, in the
launching process: that read is the header check, which refuses empty and unreadable files
together, by name, before anything is trained or written.

Items are float32 waveforms. Training: ``(C, N)``, a random window of ``clip_seconds``
(``N = clip_seconds * sample_rate`` samples) drawn from ``random.Random(seed/epoch/index)``
(the same batches for any worker count and after a resume); a shorter recording is padded with
zeros or repeated (``dataset.pad``). Evaluation: ``(V, C, N)``, ``eval_clips`` windows spread
uniformly over the recording; the classifier averages their scores per recording, as it does a
video's clips. The features (log-mel, SpecAugment) are computed on the device
(data/signals/features.py). Validation keeps the official splits when there are some
(``dataset.fold``, Speech Commands' lists, ``dataset.group``: audio_splits.py), else a seeded
``val_fraction`` held out, stratified by class. Class folders may sit in fold folders
(``root/fold<K>/<class>/``); a list file with a header may name ``fold`` and group columns.
"""

from __future__ import annotations

import csv
import logging
import os
import random
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from accel_train.data.signals.audio_splits import FOLD_DIR, fold_of, split_indices
from accel_train.data.signals.features import build_features
from accel_train.data.splits import Splits
from accel_train.errors import UserError

log = logging.getLogger(__name__)

AUDIO_EXTENSIONS = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".aif", ".aiff")
PADS = ("zeros", "repeat")
SHOWN = 5  # files named per kind of problem in the header check's paragraph


def not_a_class(name: str) -> bool:
    """Folders that hold no class: hidden ones, `_background_noise_`-like, `fold1`-like."""
    return name.startswith((".", "_")) or name.lower().startswith("fold")


def check_decoder() -> None:
    """torchcodec and FFmpeg's libraries, once, before any file is blamed."""
    try:
        from torchcodec.decoders import AudioDecoder  # noqa: F401
    except (ImportError, OSError, RuntimeError) as err:
        raise UserError(
            "dataset=audio_folder decodes with torchcodec, which cannot load here "
            f"({' '.join(str(err).split())[:200]}). Install FFmpeg's shared libraries "
            "(4 to 7: `apt install ffmpeg` or `conda install ffmpeg`) and torchcodec for your "
            "torch (`pip install torchcodec`)."
        ) from None


def build_audio_folder(
    *,
    root: str,
    list_file: str | None = None,
    sample_rate: int = 16000,
    channels: int = 1,
    clip_seconds: float = 1.0,
    pad: str = "zeros",
    eval_clips: int = 1,
    fold: str | int | None = None,
    group: str | None = None,
    features: Mapping | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
) -> Splits:
    """Train / val (/ test) splits of a folder (or list) of sound files (see the module
    docstring; the splits: audio_splits.py)."""
    for key, value, low in (("sample_rate", sample_rate, 1), ("channels", channels, 1),
                            ("eval_clips", eval_clips, 1)):  # fmt: skip
        if value < low:
            raise UserError(f"dataset.{key}={value} must be >= {low} (docs/signals.md).")
    _check_clip(clip_seconds)
    if pad not in PADS:
        raise UserError(
            f"dataset.pad={pad!r} is not one of {', '.join(PADS)}: how a recording shorter "
            "than dataset.clip_seconds is filled."
        )
    root_dir = Path(root).expanduser()
    if not root_dir.is_dir():
        raise UserError(
            f"dataset.root={root!r}: no such folder. Point `dataset.root=/path/to/sounds` at "
            "the folder that holds one sub-folder of sound files per class (or the files a "
            "dataset.list_file names, relative to it)."
        )
    check_decoder()
    paths, labels, classes, folds, groups = _sources(root_dir, list_file, group)
    durations = read_durations(paths)
    rels = [Path(os.path.relpath(p, root_dir)).as_posix() for p in paths]
    train_idx, val_idx, test_idx, how = split_indices(
        root_dir, rels, labels, fold=fold, folds=folds, groups=groups, group_key=group,
        val_fraction=val_fraction, seed=seed,
    )  # fmt: skip
    common = dict(paths=paths, labels=labels, durations=durations, rate=int(sample_rate),
                  channels=int(channels), clip=float(clip_seconds), pad=pad, seed=seed)  # fmt: skip
    log.info(
        "dataset=audio_folder: %d recordings, %d classes (%s); windows of %g s at %d Hz; "
        "validating on %d (%s), %d window(s) each",
        len(paths), len(classes), ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else ""),
        clip_seconds, sample_rate, len(val_idx), how, eval_clips,
    )  # fmt: skip
    test = AudioSplit(test_idx, views=int(eval_clips), **common) if test_idx is not None else None
    return Splits(
        AudioSplit(train_idx, views=0, **common),
        AudioSplit(val_idx, views=int(eval_clips), **common),
        test,
        in_channels=int(channels),
        image_size=round(clip_seconds * sample_rate),
        num_classes=len(classes),
        device_features=build_features(features, int(sample_rate), "audio"),
    )


def _check_clip(clip_seconds: float) -> None:
    if not clip_seconds > 0:
        raise UserError(f"dataset.clip_seconds={clip_seconds} must be > 0 (the window's length).")


def _sources(root: Path, list_file: str | None, group: str | None):
    """(absolute paths, class indices, class names, folds, groups) from the class folders or
    the list."""
    if list_file:
        rows = _read_list(Path(list_file).expanduser(), group)
        classes = sorted({r["label"] for r in rows})
        index = {c: i for i, c in enumerate(classes)}
        labels = torch.tensor([index[r["label"]] for r in rows], dtype=torch.int64)
        folds = [fold_of(r["path"], r.get("fold")) for r in rows]
        groups = [r["group"] for r in rows] if group else None
        return [str(root / r["path"]) for r in rows], labels, classes, folds, groups
    bases = [root]
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not any(not not_a_class(f) for f in folders):  # fold1/<class>/...: classes in folds
        bases = [root / f for f in folders if FOLD_DIR.match(f)] or bases
    found_classes = sorted({p.name for b in bases for p in b.iterdir() if p.is_dir()})
    skipped = [f for f in found_classes if not_a_class(f) and not f.startswith(".")]
    classes = [f for f in found_classes if not not_a_class(f)]
    if skipped:
        log.info("dataset=audio_folder: not classes (a name starting with _ or fold): %s",
                 ", ".join(skipped))  # fmt: skip
    if not classes:
        raise UserError(
            f"dataset.root={root}: no class folders (folders named _* or fold* are not "
            "classes). Put each class's sound files in its own sub-folder, root/<class>/*.wav "
            "(or root/fold<K>/<class>/*.wav), or list them in a CSV `path,label` given as "
            "dataset.list_file."
        )
    paths, labels = [], []
    for c, name in enumerate(classes):
        found = [f for b in bases for f in _sounds(b / name)]
        if not found:
            raise UserError(
                f"dataset.root: the class folder {name} under {root} has no sound files "
                f"({' '.join(AUDIO_EXTENSIONS)}). Add its files or remove the folder."
            )
        paths += found
        labels += [c] * len(found)
    folds = [fold_of(os.path.relpath(p, root), None) for p in paths]
    return paths, torch.tensor(labels, dtype=torch.int64), classes, folds, None


def _sounds(folder: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d[0] != ".")
        found += [os.path.join(dirpath, f) for f in sorted(filenames)
                  if f[0] != "." and f.lower().endswith(AUDIO_EXTENSIONS)]  # fmt: skip
    return found


def _read_list(file: Path, group: str | None) -> list[dict]:
    """Rows ``path,label`` (no header), or with a header naming ``path``, ``label`` and
    optionally ``fold`` and the ``dataset.group`` column."""
    if not file.is_file():
        raise UserError(f"dataset.list_file={file}: no such file. Give a CSV `path,label`.")
    table = [r for r in csv.reader(file.read_text(encoding="utf-8").splitlines()) if r]
    header = [c.strip().lower() for c in table[0]] if table else []
    named = header[:2] == ["path", "label"] or ("path" in header and "label" in header)
    if group and (not named or group.lower() not in header):
        raise UserError(
            f"dataset.group={group}: dataset.list_file={file} has no such column (its header: "
            f"{', '.join(header) if named else 'none'}). Add a header row naming path, label "
            f"and {group}."
        )
    cols = {k: header.index(k) for k in ("path", "label", "fold") if k in header} if named else {
        "path": 0, "label": 1}  # fmt: skip
    if group:
        cols["group"] = header.index(group.lower())
    rows = []
    for n, row in enumerate(table[1:] if named else table, 2 if named else 1):
        row = [c.strip() for c in row]
        item = {k: row[i] if i < len(row) else "" for k, i in cols.items()}
        if not item["path"] or not item["label"]:
            raise UserError(
                f"dataset.list_file={file}: row {n} has no path or no label. Each row is "
                "`path,label` (paths relative to dataset.root)."
            )
        rows.append(item)
    if not rows:
        raise UserError(f"dataset.list_file={file}: the list is empty. Add rows `path,label`.")
    return rows


def _duration(path: str) -> float | str:
    """The recording's length in seconds, or why it cannot be read."""
    from torchcodec.decoders import AudioDecoder

    if not os.path.isfile(path):
        return "missing"
    if os.path.getsize(path) == 0:
        return "empty (0 bytes)"
    try:
        decoder = AudioDecoder(path)
        meta = decoder.metadata
        seconds = meta.duration_seconds or meta.duration_seconds_from_header
        if not seconds:  # no duration in the header: decode it once
            whole = decoder.get_all_samples()
            seconds = whole.data.shape[1] / whole.sample_rate
    except (RuntimeError, ValueError, OSError) as err:
        return f"unreadable ({' '.join(str(err).split())[:120]})"
    return float(seconds) if seconds and seconds > 0 else "no samples"


def read_durations(paths: list[str]) -> np.ndarray:
    """Every file's duration, or one UserError naming every file that cannot be read."""
    got = [_duration(p) for p in paths]
    bad = [f"{p}: {g}" for p, g in zip(paths, got, strict=True) if isinstance(g, str)]
    if bad:
        more = f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
        raise UserError(
            f"dataset=audio_folder: {len(bad)} file(s) cannot be read, checked before anything "
            f"was trained or written: {'; '.join(bad[:SHOWN])}{more}. Re-encode them or move "
            "them out of dataset.root (or the list)."
        )
    return np.array(got, dtype=np.float64)


def decode_window(path: str, start: float, seconds: float, rate: int, channels: int):
    """float32 (channels, samples) of [start, start + seconds) at ``rate``: only that span is
    decoded."""
    from torchcodec.decoders import AudioDecoder

    decoder = AudioDecoder(path, sample_rate=rate, num_channels=channels)
    return decoder.get_samples_played_in_range(start, start + seconds).data


def fit(x: torch.Tensor, n: int, pad: str) -> torch.Tensor:
    """Exactly n samples: cut, or filled with zeros or repetitions of the recording."""
    if x.shape[1] >= n:
        return x[:, :n]
    if pad == "repeat" and x.shape[1] > 0:
        return x.repeat(1, -(-n // x.shape[1]))[:, :n]
    return torch.nn.functional.pad(x, (0, n - x.shape[1]))


class AudioSplit(Dataset):
    """Some recordings' windows: training ``(float32 (C, N), class)`` (``views`` 0), evaluation
    ``(float32 (V, C, N), class)`` with ``V = views`` uniform windows. Holds arrays only (the
    workers are forked, Ray pickles it)."""

    def __init__(self, indices: torch.Tensor, *, paths: list[str], labels: torch.Tensor,
                 durations: np.ndarray, rate: int, channels: int, clip: float, pad: str,
                 seed: int, views: int):  # fmt: skip
        idx = indices.tolist()
        self.paths = np.array([os.fsencode(paths[j]) for j in idx])
        self.labels = labels[indices]
        self.durations = durations[idx] if idx else np.zeros(0)
        self.rate, self.channels, self.clip, self.pad = rate, channels, clip, pad
        self.seed, self.views = seed, views
        self.views_from = f"dataset.eval_clips={views}"  # named by the device-batch line
        self.samples = round(clip * rate)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return self.getitem(i, 0)

    def getitem(self, i: int, epoch: int):
        path, spare = os.fsdecode(self.paths[i]), max(0.0, float(self.durations[i]) - self.clip)
        if self.views == 0:
            start = random.Random(f"{self.seed}/{epoch}/{i}").uniform(0.0, spare)
            starts = [start]
        else:
            starts = np.linspace(0.0, spare, self.views).tolist()
        clips = [
            fit(decode_window(path, s, self.clip, self.rate, self.channels), self.samples,
                self.pad)
            for s in starts
        ]  # fmt: skip
        x = clips[0] if self.views == 0 else torch.stack(clips)
        return x.float().contiguous(), int(self.labels[i])
