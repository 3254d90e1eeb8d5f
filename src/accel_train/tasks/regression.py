"""task=regression: `model(inputs)` predicts the target, a tensor of the target's shape; the
loss is `task.loss` (mse, l1 or huber); validation logs loss, mse and mae.

A batch is `(inputs, target)`, or a dict with `task.input_key` and `task.target_key`; float
inputs are cast to the parameters' dtype (bf16_true), targets are compared in fp32."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accel_train.config import task_facts as facts
from accel_train.config.schema import RegressionTaskConfig
from accel_train.errors import UserError
from accel_train.plugins import register_task
from accel_train.tasks.base import Task, TaskContext, evaluating

LOSSES = ("mse", "l1", "huber")


@register_task("regression", RegressionTaskConfig)
class Regression(facts.Regression, Task):
    def __init__(
        self,
        loss: str = "mse",
        huber_delta: float = 1.0,
        input_key: str = "x",
        target_key: str = "y",
    ):
        super().__init__()
        if loss not in LOSSES:
            raise UserError(
                f"task.loss={loss!r} is not one of {', '.join(LOSSES)}. E.g. `task.loss=huber`."
            )
        if huber_delta <= 0:
            raise UserError(f"task.huber_delta={huber_delta} must be > 0, e.g. 1.0.")
        self.loss, self.delta = loss, huber_delta
        self.input_key, self.target_key = input_key, target_key

    def _parts(self, batch: Any) -> tuple[Any, torch.Tensor]:
        if isinstance(batch, dict):
            return batch[self.input_key], batch[self.target_key]
        return batch[0], batch[1]

    def _losses(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Elementwise losses in fp32."""
        pred, target = pred.float(), target.float()
        if self.loss == "mse":
            return F.mse_loss(pred, target, reduction="none")
        if self.loss == "l1":
            return F.l1_loss(pred, target, reduction="none")
        return F.huber_loss(pred, target, reduction="none", delta=self.delta)

    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)
        batch = ctx.batch
        if not (
            isinstance(batch, dict) and self.input_key in batch and self.target_key in batch
        ) and not (isinstance(batch, list | tuple) and len(batch) == 2):
            keys = sorted(batch) if isinstance(batch, dict) else None
            got = f"a dict with keys {keys}" if keys is not None else type(batch).__name__
            raise UserError(
                f"task=regression: a batch is {got}, but it needs (inputs, target) pairs or "
                f"dicts with task.input_key={self.input_key!r} and task.target_key="
                f"{self.target_key!r}. Return such items from the dataset, or set those keys."
            )
        x, target = self._parts(ctx.prepared(self))
        try:
            with evaluating(ctx.model):
                pred = ctx.model(x)
        except Exception as err:
            raise UserError(
                f"model._target_={ctx.cfg.model._target_}: its forward failed on the data set's "
                f"inputs: {type(err).__name__}: {' '.join(str(err).split())[:300]}."
            ) from None
        if not isinstance(pred, torch.Tensor) or pred.shape != target.shape:
            got = tuple(pred.shape) if isinstance(pred, torch.Tensor) else type(pred).__name__
            raise UserError(
                f"model._target_={ctx.cfg.model._target_}: task=regression needs a prediction of "
                f"the target's shape {tuple(target.shape)}, but the model returned {got}. Make "
                "the model's output match the target (e.g. squeeze a trailing dimension)."
            )

    def prepare(self, batch: Any, *, train: bool, epoch: int = 0, index: int = 0) -> Any:
        x, target = self._parts(batch)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.param_dtype:
            x = x.to(self.param_dtype)  # (precision=bf16_true); the target stays as it is
        if isinstance(batch, dict):
            return {**batch, self.input_key: x}
        return x, target

    def inputs(self, batch: Any) -> Any:
        return self._parts(batch)[0]

    def step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, target = self._parts(batch)
        return self._losses(model(x), target).mean()

    def per_sample(self) -> Callable[[nn.Module, Any], torch.Tensor]:
        def score(model: nn.Module, batch: Any) -> torch.Tensor:
            x, target = self._parts(batch)
            losses = self._losses(model(x), target)
            return losses.reshape(losses.shape[0], -1).mean(1)

        return score

    def evaluate(
        self,
        model: nn.Module,
        batch: Any,
        valid: int,
        autocast: Callable[[], AbstractContextManager],
    ) -> None:
        x, target = self._parts(batch)
        with autocast():
            pred = model(x)
        k = valid
        if k == 0:
            return
        pred, target = pred[:k].float(), target[:k].float()
        m = self.eval_metrics
        per = target[0].numel()  # values per sample: the means are over all values
        m.add("loss", self._losses(pred, target).double().sum() / per, k)
        m.add("mse", F.mse_loss(pred, target, reduction="sum").double() / per, k)
        m.add("mae", F.l1_loss(pred, target, reduction="sum").double() / per, k)
