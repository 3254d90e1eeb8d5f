"""`dataset=signal_arrays`: fixed-length recordings (sensor windows, radio I/Q bursts) in arrays.

``dataset.path`` is one of:

- a folder of ``.npy`` files, one per key (``X.npy``, ``Y.npy``, ``Z.npy``), memory-mapped: only
  the rows a batch needs are read;
- an ``.npz`` file with those keys (numpy reads each member whole: for sets larger than memory
  save a folder of ``.npy`` instead);
- an HDF5 file (``.h5``, ``.hdf5``) read lazily by rows with h5py: RadioML 2018 (``X`` of shape
  (N, 1024, 2), channels last, ~21 GB in fp32; ``Y`` one-hot; ``Z`` the SNR in dB) trains
  without fitting in memory. The labels and SNRs (small) are read once.

``dataset.keys`` names the arrays: ``signal`` (N, L, C) channels last, (N, C, L) channels first
(``dataset.channels_last``; null guesses: the smaller of the two axes is the channels), (N, L)
one channel, or complex (N, L) carried as 2 real channels I and Q; ``label`` integer classes (N,)
or one-hot (N, K); ``snr`` optional (absent from the file: no accuracy per SNR). Windows reach
the model channels first, ``(C, window)`` float32. The class names are not in RadioML's file
(and the list shipped beside it is not in ``Y``'s order): ``dataset.class_names`` gives them.

Validation is a seeded ``val_fraction`` held out stratified by class and SNR together (RadioML's
file is stored grouped by both: any other cut would miss whole groups). With an SNR key,
evaluation items carry the SNR's index and the classifier logs ``val/acc_snr/<dB>``.

``dataset.window`` shorter than the recordings: training takes a random window of each (seeded
by seed/epoch/index: the same batches for any worker count and after a resume), evaluation the
centred one. Refused by name before training: a pickle (RadioML 2016's ``.pkl``: training never
unpickles; ``accel-data convert`` is the way), a window longer than every recording, NaN or
infinite samples (scanned at build for up to ``FINITE_SCAN_BYTES``, else per item as read).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from accel_train.data.signals.features import build_features
from accel_train.data.signals.sigmf_files import is_sigmf, read_sigmf
from accel_train.data.signals.tables import is_table, read_tables
from accel_train.data.signals.windows import Windows, channel_stats
from accel_train.data.splits import EvalGroups, Splits, held_out_indices
from accel_train.errors import UserError

log = logging.getLogger(__name__)

HDF5 = (".h5", ".hdf5", ".hdf")
PICKLES = (".pkl", ".pickle", ".p")
FINITE_SCAN_BYTES = 1 << 30  # signals up to this size are scanned for NaN/inf at build
CHUNK = 65536  # rows read at a time when scanning labels or samples


class ArraySource:
    """One key of ``dataset.path``, opened lazily in each process (a loader worker, a Ray actor)
    so the split pickles as a path, never as the data."""

    def __init__(self, path: Path, key: str, kind: str):
        self.path, self.key, self.kind = str(path), key, kind
        self._array, self._pid = None, None

    def array(self):
        if self._array is None or self._pid != os.getpid():
            self._array, self._pid = _open(Path(self.path), self.key, self.kind), os.getpid()
        return self._array

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_array": None, "_pid": None}


def _open(path: Path, key: str, kind: str):
    if kind == "npy":
        return np.load(path / f"{key}.npy", mmap_mode="r", allow_pickle=False)
    if kind == "npz":
        with np.load(path, allow_pickle=False) as z:
            return z[key]
    import h5py  # the [signals] extra: only a run reading HDF5 needs it

    return h5py.File(path, "r")[key]


def _kind(path: Path) -> str:
    if path.is_dir():
        return "npy"
    suffix = path.suffix.lower()
    if suffix in PICKLES:
        raise UserError(
            f"dataset.path={path}: a pickle file (RadioML 2016's .pkl is one). Training never "
            "unpickles: a pickle runs code when it is read. Convert it once to arrays with "
            f"`accel-data convert input={path} out=<folder>` (a restricted unpickler that "
            "accepts only numpy arrays), or save X/Y/Z as .npy files, .npz or HDF5 yourself."
        )
    if suffix == ".npz":
        return "npz"
    if suffix in HDF5:
        return "hdf5"
    raise UserError(
        f"dataset.path={path}: not a folder of .npy files, an .npz or an HDF5 file "
        f"(.h5, .hdf5). Point `dataset.path` at one of those (docs/signals.md)."
    )


def _keys_in(path: Path, kind: str) -> list[str]:
    if kind == "npy":
        return sorted(p.stem for p in path.glob("*.npy"))
    if kind == "npz":
        with np.load(path, allow_pickle=False) as z:
            return sorted(z.files)
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return sorted(f.keys())
    except OSError as err:
        raise UserError(f"dataset.path={path}: not a readable HDF5 file ({err}).") from None


def build_signal_arrays(
    *,
    path: str,
    keys: Mapping | None = None,
    class_names: Sequence[str] | None = None,
    channels_last: bool | None = None,
    window: int | None = None,
    stride: int | None = None,
    sample_rate: float | None = None,
    label_column: str = "label",
    recording: str | None = None,
    columns: Sequence[str] | None = None,
    features: Mapping | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
) -> Splits:
    """Train / val splits of the arrays at ``path`` (see the module docstring)."""
    file = Path(path).expanduser()
    if not file.exists():
        raise UserError(
            f"dataset.path={path!r}: no such file or folder. Point it at an HDF5 file, an .npz "
            "or a folder of .npy files (docs/signals.md)."
        )
    if is_sigmf(file) or is_table(file):
        windows = (read_sigmf(file, window, stride, sample_rate) if is_sigmf(file) else
                   read_tables(file, window, stride, label_column, recording, columns))  # fmt: skip
        return _window_splits(file, windows, class_names, features, val_fraction, seed)
    signal, layout, labels, num_classes, snr = _read(file, keys, channels_last)
    classes = _class_names(class_names, num_classes)
    length = layout.length
    window = _window_of(window, length, file)
    n = len(labels)
    scan = signal.array().size * signal.array().dtype.itemsize <= FINITE_SCAN_BYTES
    if scan:
        _check_finite(signal, n, file, signal.key)
    values, groups = _snr_groups(snr)
    strata = labels if groups is None else labels * (len(values) + 1) + groups
    train_idx, val_idx = held_out_indices(n, val_fraction, seed, strata)
    common = dict(source=signal, layout=layout, window=window, seed=seed,
                  check=not scan)  # fmt: skip
    train = ArraySplit(train_idx, labels, None, train=True, **common)
    val = ArraySplit(val_idx, labels, groups, train=False, **common)
    stats = channel_stats(train) if _kind_of(features) == "standardize" else None
    log.info(
        "dataset=signal_arrays: %d recordings of %d x %d samples (%s), %d classes (%s), "
        "windows of %d; validating on %d held out (stratified by class%s)",
        n, layout.channels, length, file.name, num_classes,
        ", ".join(classes[:8]) + (", ..." if num_classes > 8 else ""), window, len(val_idx),
        " and SNR" if groups is not None else "",
    )  # fmt: skip
    return Splits(
        train,
        val,
        None,
        in_channels=layout.channels,
        image_size=window,
        num_classes=num_classes,
        device_features=build_features(features, 0, "signal_arrays", stats),
        groups=EvalGroups("snr", [float(v) for v in values]) if values is not None else None,
    )


def _window_of(window: int | None, length: int, file: Path) -> int:
    window = int(window) if window else length
    if window > length or window < 1:
        raise UserError(
            f"dataset.window={window} is longer than every recording of {file}: each holds "
            f"{length} samples. Set `dataset.window` to at most {length} (null: the whole "
            "recording)."
        )
    return window


def _snr_groups(snr: np.ndarray | None):
    """(the distinct SNRs, each recording's index among them), or (None, None)."""
    if snr is None:
        return None, None
    values, groups = np.unique(snr, return_inverse=True)
    return values, torch.as_tensor(groups.reshape(-1), dtype=torch.int64)


def _kind_of(features: Mapping | None) -> str:
    return str(dict(features or {}).get("kind", "none"))


def _window_splits(file: Path, windows: Windows, class_names, features, val_fraction: float,
                   seed: int) -> Splits:  # fmt: skip
    """Splits of windows cut from recordings (SigMF, CSV/Parquet): held out stratified by
    class."""
    if class_names:
        _class_names(class_names, len(windows.classes))
    train_idx, val_idx = held_out_indices(len(windows.labels), val_fraction, seed, windows.labels)
    train, val = windows.split(train_idx), windows.split(val_idx)
    stats = channel_stats(train) if _kind_of(features) == "standardize" else None
    log.info(
        "dataset=signal_arrays: %d windows of %d x %d samples from %s, %d classes (%s); "
        "validating on %d held out (stratified by class)",
        len(windows.labels), windows.channels, windows.window, file.name, len(windows.classes),
        ", ".join(windows.classes[:8]) + (", ..." if len(windows.classes) > 8 else ""),
        len(val_idx),
    )  # fmt: skip
    return Splits(
        train,
        val,
        None,
        in_channels=windows.channels,
        image_size=windows.window,
        num_classes=len(windows.classes),
        device_features=build_features(features, 0, "signal_arrays", stats),
    )


def _read(file: Path, keys: Mapping | None, channels_last: bool | None):
    """(the signal's source, its layout, class indices, number of classes, SNRs or None)."""
    kind = _kind(file)
    names = {"signal": "X", "label": "Y", "snr": "Z", **dict(keys or {})}
    present = _keys_in(file, kind)
    for role in ("signal", "label"):
        if names[role] not in present:
            raise UserError(
                f"dataset.keys.{role}={names[role]!r}: {file} has no such array (it holds "
                f"{', '.join(present) or 'none'}). Set `dataset.keys.{role}=<name>`."
            )
    signal = ArraySource(file, names["signal"], kind)
    shape, dtype = tuple(signal.array().shape), signal.array().dtype
    layout = _layout(shape, dtype, channels_last, file)
    labels, num_classes = _labels(ArraySource(file, names["label"], kind).array(), shape[0], file)
    snr = None
    if names["snr"] and names["snr"] in present:
        snr = np.asarray(ArraySource(file, names["snr"], kind).array()[:]).reshape(-1)
        if len(snr) != shape[0]:
            raise UserError(
                f"dataset.keys.snr={names['snr']!r}: {file} has {len(snr)} SNRs for {shape[0]} "
                "signals (one per signal), or set `dataset.keys.snr=null`."
            )
    elif names["snr"]:
        log.info("dataset=signal_arrays: %s has no %r array: no accuracy per SNR", file,
                 names["snr"])  # fmt: skip
    return signal, layout, labels, num_classes, snr


class Layout:
    """How a row of the signal array becomes ``(channels, length)`` float32."""

    def __init__(self, channels: int, length: int, channels_last: bool, complex_: bool):
        self.channels, self.length = channels, length
        self.channels_last, self.complex = channels_last, complex_

    def row(self, raw: np.ndarray) -> np.ndarray:
        if self.complex:  # (L,) complex -> (2, L): I and Q
            return np.stack([raw.real, raw.imag]).astype(np.float32)
        if raw.ndim == 1:
            return raw.astype(np.float32)[None]
        return (raw.T if self.channels_last else raw).astype(np.float32)


def _layout(shape: tuple, dtype: np.dtype, channels_last: bool | None, file: Path) -> Layout:
    if np.issubdtype(dtype, np.complexfloating) and len(shape) == 2:
        return Layout(2, shape[1], False, True)
    if len(shape) == 2:
        return Layout(1, shape[1], False, False)
    if len(shape) != 3 or not np.issubdtype(dtype, np.number):
        raise UserError(
            f"dataset.keys.signal: the signal array of {file} has shape {shape} ({dtype}); it "
            "must be (N, length, channels), (N, channels, length), (N, length) or complex "
            "(N, length)."
        )
    last = shape[2] < shape[1] if channels_last is None else bool(channels_last)
    return Layout(shape[2] if last else shape[1], shape[1] if last else shape[2], last, False)


def _labels(array, n: int, file: Path) -> tuple[torch.Tensor, int]:
    """Class indices (N,) from integer labels or one-hot rows, read a chunk at a time."""
    shape = tuple(array.shape)
    if shape[0] != n:
        raise UserError(
            f"dataset.keys.label: {file} has {shape[0]} labels for {n} signals. The label "
            "array must have one row per signal."
        )
    parts = []
    for start in range(0, n, CHUNK):
        rows = np.asarray(array[start : start + CHUNK])
        if rows.ndim == 2 and rows.shape[1] > 1:  # one-hot (RadioML's Y)
            parts.append(rows.argmax(1))
        else:
            parts.append(rows.reshape(-1))
    labels = np.concatenate(parts) if parts else np.zeros(0)
    if not np.issubdtype(labels.dtype, np.integer) and not np.all(labels == np.round(labels)):
        raise UserError(
            f"dataset.keys.label: the labels of {file} are not class indices or one-hot rows "
            "(they hold fractions). Save integer classes (N,) or one-hot (N, classes)."
        )
    labels = torch.as_tensor(labels.astype(np.int64))
    if n and int(labels.min()) < 0:
        raise UserError(f"dataset.keys.label: {file} has a negative class index.")
    width = shape[1] if len(shape) == 2 and shape[1] > 1 else int(labels.max()) + 1
    return labels, int(width)


def _class_names(names: Sequence[str] | None, num_classes: int) -> list[str]:
    if not names:
        return [str(i) for i in range(num_classes)]
    names = [str(c) for c in names]
    if len(names) != num_classes:
        raise UserError(
            f"dataset.class_names has {len(names)} names but the labels give {num_classes} "
            "classes: give one name per class, in the labels' order (RadioML 2018's Y order, "
            "not the list shipped beside it)."
        )
    return names


def _check_finite(source: ArraySource, n: int, file: Path, key: str) -> None:
    array = source.array()
    for start in range(0, n, CHUNK):
        rows = np.asarray(array[start : start + CHUNK])
        bad = ~np.isfinite(rows.reshape(rows.shape[0], -1)).all(1)
        if bad.any():
            first = start + int(np.flatnonzero(bad)[0])
            raise UserError(
                f"dataset.path={file}: the signal {key!r} holds NaN or infinite samples (row "
                f"{first} first, {int(bad.sum())} rows in rows {start}-{start + len(rows) - 1}). "
                "Drop or repair those rows; training on them makes the loss NaN."
            )


class ArraySplit(Dataset):
    """Windows of some rows: ``(float32 (C, window), class)``, with the SNR's index as a third
    element in evaluation when the data has one (Splits.groups). ``labels``: every row's class,
    kept here for the label checks (no signal read)."""

    def __init__(self, indices: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor | None,
                 *, source: ArraySource, layout: Layout, window: int, seed: int, train: bool,
                 check: bool):  # fmt: skip
        self.rows = indices.numpy().astype(np.int64)
        self.labels = labels[indices]
        self.groups = groups[indices] if groups is not None else None
        self.source, self.layout, self.window = source, layout, window
        self.seed, self.train, self.check = seed, train, check

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.getitem(i, 0)

    def getitem(self, i: int, epoch: int):
        row = int(self.rows[i])
        x = self.layout.row(np.asarray(self.source.array()[row]))
        if self.check and not np.isfinite(x).all():
            raise UserError(
                f"dataset.path={self.source.path}: row {row} of {self.source.key!r} holds NaN or "
                "infinite samples. Drop or repair it; training on it makes the loss NaN."
            )
        spare = x.shape[1] - self.window
        if spare > 0:
            rng = random.Random(f"{self.seed}/{epoch}/{i}")
            start = rng.randint(0, spare) if self.train else spare // 2
            x = x[:, start : start + self.window]
        item = torch.from_numpy(np.ascontiguousarray(x))
        if self.groups is not None:
            return item, int(self.labels[i]), int(self.groups[i])
        return item, int(self.labels[i])
