"""task=custom: the user's own step, `task.step=my_project.steps.step`:

    def step(model, batch):          # under autocast, the model in train mode
        ...
        return loss                  # the batch's mean loss (a scalar tensor with a gradient)
        return loss, {"mae": mae}    # ... and metrics (scalar tensors, means over the batch)
        return loss_sum, n_items     # a summed loss and its item count (a tensor or int): the
                                     # loop divides once by the items of the whole accumulated,
                                     # all-reduced batch (token losses, padding)
        return loss_sum, n_items, {"acc": acc}

Metrics are logged as train/<name>, val/<name> and test/<name>; name the ones validation logs in
`task.metrics` (name: min|max) to monitor them or sweep on them. Return the same names on every
step: with several processes they are summed in one all-reduce, whose size every rank must agree
on (the declared ones are made up front, so a rank that scores only padding still has them).
`task.eval_step` (same signature and returns) replaces the step for validation and test, run
without gradients."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from accel_train.config import task_facts as facts
from accel_train.config.schema import CustomTaskConfig
from accel_train.data.batch import count_samples
from accel_train.errors import UserError
from accel_train.plugins import register_task
from accel_train.targets import locate
from accel_train.tasks.base import Task, TaskContext, split_output


def _function(path: str, key: str):
    fn = locate(str(path), key)
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise UserError(
            f"{key}={path} cannot be called as {path.rsplit('.', 1)[-1]}(model, batch): its "
            f"signature is {inspect.signature(fn)}. A step takes the model and the batch."
        ) from None
    except ValueError:  # no signature to read: try it
        pass
    return fn


@register_task("custom", CustomTaskConfig)
class Custom(facts.Custom, Task):
    def __init__(self, step: str, eval_step: str | None = None, metrics: Any = None):
        super().__init__()
        self.path = str(step)
        self.fn = _function(step, "task.step")
        self.eval_fn = _function(eval_step, "task.eval_step") if eval_step else self.fn

    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)
        model = ctx.model
        was = model.training
        model.eval()  # no dropout draws at the check: the RNG stream stays the training's
        try:
            with torch.enable_grad():
                out = self.fn(model, ctx.prepared(self))
        except UserError:
            raise
        except Exception as err:
            raise UserError(
                f"task.step={self.path}: it failed on two samples of the training set: "
                f"{type(err).__name__}: {' '.join(str(err).split())[:300]}. Fix the step (or "
                "the data set it reads)."
            ) from None
        finally:
            model.train(was)
        loss, items, metrics = split_output(out)
        forms = (
            "return the mean loss, (loss, {name: tensor}), (loss_sum, n_items) or "
            "(loss_sum, n_items, {name: tensor})"
        )
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(
                f"task.step={self.path} returned a loss of {got}, not a scalar tensor: {forms}."
            )
        if not loss.requires_grad:
            raise UserError(
                f"task.step={self.path} returned a loss without a gradient (requires_grad is "
                "False): compute it from the model's output, not under torch.no_grad() or "
                "from .detach()/.item() values."
            )
        if items is not None and not (
            isinstance(items, int) or (isinstance(items, torch.Tensor) and items.dim() == 0)
        ):
            raise UserError(
                f"task.step={self.path} returned n_items of {type(items).__name__}: the second "
                f"value must be the item count (an int or a scalar tensor); {forms}."
            )
        if not isinstance(metrics, Mapping) or not all(
            isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values()
        ):
            raise UserError(
                f"task.step={self.path}: its metrics must be a dict of scalar tensors "
                "(e.g. {'mae': mae}), means over the batch."
            )
        if "loss" in metrics:
            raise UserError(
                f"task.step={self.path}: a metric named 'loss' would overwrite the loss; rename it."
            )

    def step(self, model: nn.Module, batch: Any):
        loss, items, metrics = split_output(self.fn(model, batch))
        if metrics:
            n = count_samples(batch)
            for key, value in metrics.items():
                # Device tensors, weighted by samples; read at the logging step only.
                self.train_metrics.add(key, value.detach().float() * n, n)
        return loss if items is None else (loss, items)

    def forward(self, model: nn.Module, batch: Any) -> Any:
        return self.eval_fn(model, batch)  # the user's step: its metrics are not recorded here

    def eval_output(self, model: nn.Module, batch: Any) -> Any:
        return self.eval_fn(model, batch)
