"""checkpoint: which checkpoint files a run keeps."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    """Which checkpoint files a run keeps (Lightning's ModelCheckpoint keys)."""

    name: str = "default"
    monitor: str = "val/acc"
    mode: str = "max"
    save_top_k: int = 1
    filename: str | None = None
    every_n_epochs: int = 1
    save_last: bool = True
    async_save: bool = False
