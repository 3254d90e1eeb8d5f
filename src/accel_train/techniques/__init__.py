"""The technique layer: every speed-up or training technique is one small class here.

A technique may transform the model once at build time, hook into the loop, or both. The loop
(``accel_train.train.loop``) fires the hooks in this order::

    before_build()                              process-wide setup, before data and model exist
    transform(model, ctx) -> model              at build time, in ascending `order` (below)
    wrap_loss(loop, compute) -> compute         once, as the loop is made (first one outermost)
    on_fit_start(loop)                          after resume, before the first step
    for each epoch:
        for each optimizer step:
            loss = compute(batch) under autocast (the task's step), backward,
            on_loss(loop, loss, n), optimizer step
            on_train_step_end(loop)             device tensors only: NO host sync here
            [every log_every_n_steps]  on_log(loop, metrics)        host sync allowed
            [validation]  on_validation_start(loop) ... on_validation_end(loop, metrics),
                          checkpoints saved, after_validation(loop)
            [checkpoint]  on_save(loop, name), then state_dict() saved under
                          checkpoint["techniques"][name]   host sync allowed
    on_fit_end(loop)                            always, also when the run stops early
    summary(loop) -> dict                       fields for summary.json (a finished run)

Model transforms run in one ordered list, so techniques compose without knowing each other:

    PREPARE (10)   change the modules themselves (pruning, quantization-aware training)
    MEMORY  (20)   activation checkpointing
    LAYOUT  (30)   memory format (channels_last)
    -- PARALLEL (50): DDP / FSDP wrapping, done by the builder --
    COMPILE (60)   torch.compile, outermost; applied to the training and the evaluation model

Users add their own loop hooks by ``_target_`` (``+callbacks.NAME._target_=pkg.mod.Class``);
those are Technique subclasses too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from accel_train.data.transform import BatchTransform
from accel_train.parallel import DistEnv
from accel_train.strategies import Strategy, strategy_for
from accel_train.tasks import Task

PREPARE, MEMORY, LAYOUT, PARALLEL, COMPILE = 10, 20, 30, 50, 60

# A (prepared) batch -> the task's step output: a mean loss, or (loss_sum, n_items).
LossFn = Callable[[Any], Any]


@dataclass
class BuildContext:
    """What a model transform may look at (or adjust) besides the model."""

    cfg: DictConfig
    env: DistEnv
    batch_transform: BatchTransform
    sample: Any  # two real training inputs, as the model will see them (the task's inputs)
    task: Task | None = None  # the run's task: what techniques that depend on it ask
    batch: Any = None  # the two samples' whole batch, prepared by the task
    strategy: Strategy | None = None  # the run's parallelism: what it shards, replicates

    def __post_init__(self) -> None:
        if self.strategy is None:
            self.strategy = strategy_for(self.cfg)


class Technique:
    """Base class: every hook is a no-op. Override what the technique needs."""

    name = "technique"
    order = PREPARE  # where `transform` runs in the build order

    def before_build(self) -> None:
        pass

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        return model

    @property
    def wraps_loss(self) -> bool:
        """Whether this technique's `wrap_loss` changes the step (a strategy that runs the step
        itself, the pipeline, refuses it)."""
        return type(self).wrap_loss is not Technique.wrap_loss

    def wrap_loss(self, loop: Any, compute: LossFn) -> LossFn:
        """Change what a training micro-batch computes: return a function batch -> loss that
        calls `compute` (the task's step, or the next wrapper). Runs under autocast, on device
        tensors: no host sync."""
        return compute

    def on_loss(self, loop: Any, loss: torch.Tensor, n: int) -> None:
        """Every training micro-batch's loss (detached, a mean over its `n` samples or items),
        on the device: no host sync. Only techniques that override it are called."""

    def on_fit_start(self, loop: Any) -> None:
        pass

    def on_train_step_end(self, loop: Any) -> None:
        pass

    def on_log(self, loop: Any, metrics: dict[str, float]) -> None:
        pass

    def on_validation_start(self, loop: Any) -> None:
        pass

    def on_validation_end(self, loop: Any, metrics: dict[str, float]) -> None:
        pass

    def after_validation(self, loop: Any) -> None:
        """After validation's checkpoint (best.pt, top k) was written: e.g. ema swaps the
        training weights back in only here, so that checkpoint holds the validated weights."""

    def on_save(self, loop: Any, name: str) -> None:
        pass

    def on_fit_end(self, loop: Any) -> None:
        pass

    def summary(self, loop: Any) -> dict[str, Any]:
        """Fields for summary.json, at the end of the run (host sync allowed)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
