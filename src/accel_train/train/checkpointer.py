"""The one checkpointer of a run: writes a checkpoint (one file, or a sharded .dcp directory,
synchronously or staged and written in the background), waits for it, and loads weights back.
The loop calls `save`, `wait_before_weights_change`, `wait`, `load_weights` and `close`;
which files are kept, named and ranked is train/checkpointing.py's; resume's reading is
train/resume.py's. torchtitan's CheckpointManager (save, maybe_wait_for_staging, load, close)
is the model of this shape.

checkpoint.async_save (async_save.py): the state is staged to host memory (pinned on CUDA) and
written by one background thread, at most one save in flight; the loop waits for the copy only
before the weights change (the optimizer step, a validation, the next save, the exit)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from accel_train.async_save import AsyncSaver
from accel_train.checkpoint_formats import format_named, format_of
from accel_train.loggers import MetricsLogger
from accel_train.parallel import DistEnv
from accel_train.strategies import Strategy

log = logging.getLogger("accel_train")


class Checkpointer:
    def __init__(
        self,
        cfg: DictConfig,
        env: DistEnv,
        strategy: Strategy,
        ckpt_dir: Path,
        metrics: MetricsLogger,
        state: Callable[[], dict[str, Any]],
    ):
        """`state()`: everything but the model and optimizer (progress, RNG, techniques...)."""
        self.env, self.ckpt_dir, self.metrics, self._state = env, ckpt_dir, metrics, state
        # The strategy names the format (checkpoint_formats/): one file, or a sharded
        # torch.distributed.checkpoint directory; `sharded`: the run's own model is sharded.
        self.format = format_named(strategy.checkpoint_format(env.distributed))
        self.suffix = self.format.suffix
        self.sharded = strategy.sharded_checkpoints and env.distributed
        self.flat_optimizer = self.sharded and strategy.optimizer_state_by_name
        # checkpoint.async_save: the background writer; sharded saves get a process group of
        # their own, created here on every rank.
        self.saver = (
            AsyncSaver(
                dist.new_group(backend="gloo") if self.sharded else None,
                cuda=env.device.type == "cuda",
            )
            if cfg.checkpoint.async_save
            else None
        )
        self._row = None  # an async save's metrics row, logged once its copy is complete

    def path(self, name: str) -> Path:
        return self.ckpt_dir / f"{name}{self.suffix}"

    def save(self, name: str, module, optimizer, step: int, epoch: int, then=None) -> None:
        """Write checkpoint `name` in the run's format (then call `then` on rank 0, once it is
        complete). The time the loop is blocked is logged as checkpoint/blocked_s: the whole
        write, or with checkpoint.async_save this call (the wait for the previous save, the
        copy of what the forward pass may change) plus the wait for the background copy at the
        next change of the weights (wait_before_weights_change)."""
        # HOST SYNC (checkpoint): state_dict() copies device tensors to the file.
        start = time.perf_counter()
        saver = self.saver
        row = {"event": "checkpoint", "name": name}
        if saver is not None:
            self.wait_before_weights_change()  # the previous save's row first
            row["checkpoint/waited_s"] = saver.wait()  # at most one save in flight
            saver.begin()
        self.format.save(
            module,
            optimizer,
            self._state(),
            self.path(name),
            self.env,
            saver=saver,
            then=then,
            flat_optimizer=self.flat_optimizer,
        )
        # An event row: two saves at one step (a top-k file and last) are two facts, not one
        # metric logged twice, and a resume's rewind keeps them.
        row["checkpoint/blocked_s"] = time.perf_counter() - start
        if saver is None:
            self.metrics.log(row, step, epoch)
        else:  # logged once the copy is complete, with the time waited for it
            self._row = (row, step, epoch)

    def wait_before_weights_change(self) -> None:
        """checkpoint.async_save: the background copy of the last save's state complete, before
        anything changes the weights or the optimizer state (the optimizer step, a validation,
        the next save, the exit); the save's row is logged now, the wait added to its
        checkpoint/blocked_s."""
        if self._row is None:
            return
        (row, step, epoch), self._row = self._row, None
        row["checkpoint/blocked_s"] += self.saver.staged()
        self.metrics.log(row, step, epoch)

    def wait(self) -> None:
        """checkpoint.async_save: the last save complete (before the test pass reads best,
        before the run exits or stops for a requeue); its error raised here."""
        if self.saver is not None:
            self.wait_before_weights_change()
            waited = self.saver.wait()
            if waited > 0.01 and self.env.is_main:
                log.info("waited %.2f s for the last checkpoint save to complete", waited)

    def load_weights(self, module: nn.Module, path: Path) -> None:
        """The model's weights from one of this run's checkpoints (the test pass's best)."""
        fmt = format_of(path)
        fmt.load_model(module, path, fmt.read(path, key="ckpt_path"))

    def close(self) -> None:
        """A save still in flight completes (the run failed elsewhere: its error is the one
        raised, this one only logged)."""
        if self.saver is None:
            return
        try:
            self.saver.close()
        except Exception as err:  # noqa: BLE001 - the run's own error is the one raised
            log.warning("the last asynchronous checkpoint save failed too: %s", err)
