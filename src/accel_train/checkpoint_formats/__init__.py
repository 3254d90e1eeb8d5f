"""Checkpoint formats: one small class per format (base.py says what a format does), chosen by
name from the registry below when writing (a strategy names its format) and by what is on disk
when reading. To add one: a file here, its line in CHECKPOINT_FORMATS, and the strategies that
write it name it (docs/architecture.md)."""

from __future__ import annotations

from pathlib import Path

from accel_train.checkpoint_formats.base import CheckpointFormat
from accel_train.checkpoint_formats.dcp import Sharded
from accel_train.checkpoint_formats.file import SingleFile

__all__ = ["CHECKPOINT_FORMATS", "CheckpointFormat", "format_named", "format_of"]

CHECKPOINT_FORMATS: dict[str, CheckpointFormat] = {
    "file": SingleFile(),
    "dcp": Sharded(),
}


def format_named(name: str) -> CheckpointFormat:
    return CHECKPOINT_FORMATS[name]


def format_of(path: Path) -> CheckpointFormat:
    """The format of the checkpoint at `path`: the last registered one that matches it (a
    format added later may claim paths an earlier one would too)."""
    for fmt in reversed(list(CHECKPOINT_FORMATS.values())):
        if fmt.matches(path):
            return fmt
    return CHECKPOINT_FORMATS["file"]
