"""A sharded directory (`.dcp`): torch.distributed.checkpoint writes every rank's shards, rank 0
adds meta.pt (the rest of the state) and renames the directory into place. It loads at any
world size and under any sharded or unsharded strategy (one process consolidates it). FSDP, TP,
FSDP x TP and pipeline runs write it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from accel_train import checkpoint as ckpt_io
from accel_train.checkpoint_formats.base import CheckpointFormat
from accel_train.state_copy import copy_all_but


class Sharded(CheckpointFormat):
    name = "dcp"
    suffix = ".dcp"
    state_holds_weights = False

    def matches(self, path: Path) -> bool:
        return path.is_dir()

    def complete(self, path: Path) -> Path:
        return path / "meta.pt"  # written last, then the directory is renamed into place

    def save(
        self, module, optimizer, rest, path, env, *, saver=None, then=None, flat_optimizer=False
    ):
        meta = {"format": ckpt_io.FORMAT_VERSION, **rest}
        ckpt_io.save_sharded(
            module,
            optimizer,
            copy_all_but(meta),  # the small rest; DCP copies the shards
            path,
            env.is_main,
            flat_optimizer=flat_optimizer,
            saver=saver,
            then=then,
        )
        if saver is None and then is not None:
            then()

    def read(self, path: Path, key: str) -> dict[str, Any]:
        return ckpt_io.load_sharded_meta(path, key=key)

    def load_model(self, module: nn.Module, path: Path, state: dict[str, Any]) -> None:
        ckpt_io.load_sharded(module, None, path)  # consolidated into this process's model

    def load_training(self, module, optimizer, path, state, sharded) -> None:
        ckpt_io.load_sharded(module, optimizer, path)
