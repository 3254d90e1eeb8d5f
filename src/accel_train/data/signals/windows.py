"""Windows cut from recordings of different lengths (SigMF annotations, CSV/Parquet series).

Each item is ``(recording, start)``: ``window`` samples from ``start`` of one recording, read by
that recording's reader (``read(start, count) -> float32 (C, count)``), never across two
recordings. The readers hold paths or small arrays, so a split pickles cheaply (loader workers,
Ray actors) and a reader of a file opens it again in each process.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

STATS_ITEMS = 4096  # training windows read (evenly spaced) to measure per-channel statistics


def starts(length: int, window: int, stride: int) -> list[int]:
    """The window starts of a recording of ``length`` samples (none if it is shorter)."""
    return list(range(0, length - window + 1, stride)) if length >= window else []


@dataclass
class Windows:
    """Every window of a data set: its recording, start and class."""

    readers: list
    sources: np.ndarray
    offsets: np.ndarray
    labels: torch.Tensor
    classes: list[str]
    channels: int
    window: int

    def split(self, indices: torch.Tensor) -> WindowSplit:
        return WindowSplit(
            indices, readers=self.readers, sources=self.sources, offsets=self.offsets,
            labels=self.labels, window=self.window,
        )  # fmt: skip


class WindowSplit(Dataset):
    """Some windows: ``(float32 (C, window), class)``."""

    def __init__(self, indices: torch.Tensor, *, readers: list, sources: np.ndarray,
                 offsets: np.ndarray, labels: torch.Tensor, window: int):  # fmt: skip
        idx = indices.numpy().astype(np.int64)
        self.readers, self.window = readers, window
        self.sources, self.offsets = sources[idx], offsets[idx]
        self.labels = labels[indices]

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i: int):
        return self.getitem(i, 0)

    def getitem(self, i: int, epoch: int):
        reader = self.readers[int(self.sources[i])]
        x = reader.read(int(self.offsets[i]), self.window)
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), int(self.labels[i])


def channel_stats(split: Dataset) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation over (up to STATS_ITEMS evenly spaced) training
    windows: measured once, on the training split only, so validation never leaks into them."""
    n = len(split)
    picks = np.unique(np.linspace(0, n - 1, min(n, STATS_ITEMS)).round().astype(np.int64))
    total = square = None
    count = 0
    for i in picks.tolist():
        x = split[i][0].double()
        total = x.sum(1) if total is None else total + x.sum(1)
        square = x.square().sum(1) if square is None else square + x.square().sum(1)
        count += x.shape[1]
    mean = total / count
    std = (square / count - mean.square()).clamp_min(0).sqrt().clamp_min(1e-8)
    return mean.tolist(), std.tolist()
