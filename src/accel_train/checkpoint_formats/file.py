"""One file (`.pt`): the whole state in one torch.save, written by rank 0 to a temp file and
renamed into place; read with torch.load(weights_only=True). Single-process and DDP runs write
it; a sharded run resumes from it by cutting the whole weights into its shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from accel_train import checkpoint as ckpt_io
from accel_train.checkpoint_formats.base import CheckpointFormat
from accel_train.state_copy import copy_all_but, step_only_storages


class SingleFile(CheckpointFormat):
    name = "file"
    suffix = ".pt"

    def matches(self, path: Path) -> bool:
        return not path.is_dir()

    def save(
        self, module, optimizer, rest, path, env, *, saver=None, then=None, flat_optimizer=False
    ):
        if saver is None:
            if env.is_main:
                ckpt_io.atomic_save(self._whole(module, optimizer, rest), path)
            env.barrier()
            if then is not None:
                then()
            return
        if env.is_main:
            # What only the optimizer step changes is copied later, in the background; the
            # loop waits for that copy before the step (Checkpointer.wait_before_weights_change).
            later = step_only_storages(module, optimizer)
            state = copy_all_but(self._whole(module, optimizer, rest), later)
            saver.save_file(state, lambda staged: _write_then(staged, path, then))

    @staticmethod
    def _whole(module: nn.Module, optimizer, rest: dict[str, Any]) -> dict[str, Any]:
        return {
            "format": ckpt_io.FORMAT_VERSION,
            "model": module.state_dict(),
            "optimizer": optimizer.state_dict(),
            **rest,
        }

    def read(self, path: Path, key: str) -> dict[str, Any]:
        return ckpt_io.load_checkpoint(path, key=key)

    def load_model(self, module: nn.Module, path: Path, state: dict[str, Any]) -> None:
        module.load_state_dict(state["model"])

    def load_training(self, module, optimizer, path, state, sharded) -> None:
        if sharded:  # the whole weights cut into this run's shards
            ckpt_io.load_full_into_sharded(module, optimizer, state)
            return
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


def _write_then(state: dict[str, Any], path: Path, then) -> None:
    """The background half of an asynchronous single-file save (rank 0)."""
    ckpt_io.atomic_save(state, path)
    if then is not None:
        then()
