"""CSV / Parquet time series for ``dataset=signal_arrays`` (sensor recordings, UCI-HAR-style).

``dataset.path`` is one ``.csv`` / ``.parquet`` file or a folder of them. Each row is one time
step: the channels (``dataset.columns``; null: every numeric column but the label and the
recording), the class (``dataset.label_column``) and, optionally, the recording it belongs to
(``dataset.recording``; null: each file is one recording). Windows of ``dataset.window`` rows
every ``dataset.stride`` (null: the window; half of it is UCI-HAR's 50 % overlap) are cut per
recording and per run of one label, never across two recordings or two classes. A window
holding a NaN is refused, naming the file and the row (the header is line 1, so the row is the
spreadsheet's line number for a CSV). The tables are read into memory once (sensor sets are
small); a window is a slice of it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from accel_train.data.signals.windows import Windows, starts
from accel_train.errors import UserError

TABLES = (".csv", ".parquet", ".pq")


def is_table(path: Path) -> bool:
    if path.is_dir():
        return any(p.suffix.lower() in TABLES for p in path.iterdir())
    return path.suffix.lower() in TABLES


class TableReader:
    """One recording's channels, (C, T) float32, held in memory."""

    def __init__(self, data: np.ndarray):
        self.data = data

    def read(self, start: int, count: int) -> np.ndarray:
        return self.data[:, start : start + count]


def _load(file: Path):
    import pandas as pd

    try:
        if file.suffix.lower() == ".csv":
            return pd.read_csv(file)
        return pd.read_parquet(file)
    except (OSError, ValueError, ImportError) as err:
        why = " ".join(str(err).split())[:200]
        raise UserError(f"dataset.path: {file} cannot be read as a table ({why}).") from None


def _check_windows(file: Path, data: np.ndarray, lo: int, cut: list[int], window: int,
                   key) -> None:  # fmt: skip
    """A window holding a NaN (or an empty cell) is refused, naming the file and the row."""
    bad = ~np.isfinite(data).all(1)
    for s in cut:
        if bad[s : s + window].any():
            row = lo + s + int(np.flatnonzero(bad[s : s + window])[0])
            raise UserError(
                f"dataset.path: {file} row {row + 2} (data row {row}, counting from 0) holds "
                f"NaN or an empty cell, inside a window of recording {key!s}. Fill or drop "
                "that row; training on it makes the loss NaN."
            )


def read_tables(path: Path, window: int | None, stride: int | None, label_column: str,
                recording: str | None, columns=None) -> Windows:  # fmt: skip
    """Every recording's windows (see the module docstring)."""
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix.lower() in TABLES)  # fmt: skip
    if not window:
        raise UserError(
            f"dataset.window is required for the time series of {path}: the number of rows "
            "per window (e.g. `dataset.window=128`, UCI-HAR's 2.56 s at 50 Hz)."
        )
    window, stride = int(window), int(stride) if stride else int(window)
    readers, sources, offsets, names, chosen = [], [], [], [], None
    for file in files:
        table = _load(file)
        need = [label_column] + ([recording] if recording else []) + list(columns or [])
        missing = [c for c in need if c not in table.columns]
        if missing:
            raise UserError(
                f"dataset: {file} has no column {', '.join(missing)} (it has "
                f"{', '.join(map(str, table.columns[:12]))}). Set `dataset.label_column`, "
                "`dataset.recording` or `dataset.columns` to its columns' names."
            )
        skip = {label_column, recording}
        numeric = [c for c in table.columns if c not in skip and table[c].dtype.kind in "biuf"]
        cols = list(columns) if columns else numeric
        if chosen is not None and cols != chosen:
            raise UserError(
                f"dataset: {file}'s channels ({', '.join(cols)}) differ from the first file's "
                f"({', '.join(chosen)}). Give the same columns, or name them in dataset.columns."
            )
        chosen = cols
        values = table[cols].to_numpy(np.float32)
        labels = table[label_column].astype(str).to_numpy()
        keys = table[recording].astype(str).to_numpy() if recording else np.zeros(len(table))
        # Runs of one (recording, label): rows in file order, a new run at each change.
        change = np.flatnonzero((keys[1:] != keys[:-1]) | (labels[1:] != labels[:-1])) + 1
        for lo, hi in zip([0, *change.tolist()], [*change.tolist(), len(table)], strict=True):
            cut = starts(hi - lo, window, stride)
            if not cut:
                continue
            data = values[lo:hi]
            _check_windows(file, data, lo, cut, window, keys[lo])
            readers.append(TableReader(np.ascontiguousarray(data.T)))
            sources += [len(readers) - 1] * len(cut)
            offsets += cut
            names += [str(labels[lo])] * len(cut)
    if not sources:
        raise UserError(
            f"dataset.window={window} is longer than every recording of {path} (each run of "
            "one recording and label is shorter). Set a smaller `dataset.window`."
        )
    classes = sorted(set(names))
    index = {c: i for i, c in enumerate(classes)}
    labels_t = torch.tensor([index[c] for c in names], dtype=torch.int64)
    return Windows(readers, np.array(sources), np.array(offsets), labels_t, classes,
                   len(chosen), window)  # fmt: skip
