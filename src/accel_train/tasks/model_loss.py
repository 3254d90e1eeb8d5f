"""task=model_loss: the model computes its own loss (the Hugging Face habit). A dict batch is
passed as keyword arguments (`model(**batch)`), a tuple or list as positional ones, a tensor as
the one argument; the model returns an object with `.loss`, a mapping with "loss", or the loss
itself (a scalar tensor)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from accel_train.config import task_facts as facts
from accel_train.config.schema import TaskConfig
from accel_train.errors import UserError
from accel_train.plugins import register_task
from accel_train.tasks.base import Task, TaskContext, evaluating


def call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, list | tuple):
        return model(*batch)
    return model(batch)


def loss_of(out: Any) -> torch.Tensor | None:
    """The loss a model returned, or None when it returned none."""
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else None
    if isinstance(out, Mapping):
        return out.get("loss")
    loss = getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


@register_task("model_loss", TaskConfig)
class ModelLoss(facts.ModelLoss, Task):
    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)
        model = ctx.model
        try:
            with evaluating(model):
                out = call(model, ctx.prepared(self))
        except Exception as err:
            raise UserError(
                f"model._target_={ctx.cfg.model._target_} with task=model_loss: calling the "
                f"model with a batch ({_shape(ctx.batch)}) failed: {type(err).__name__}: "
                f"{' '.join(str(err).split())[:300]}. A dict batch is passed as keyword "
                "arguments, a tuple as positional ones."
            ) from None
        loss = loss_of(out)
        if loss is None or loss.dim() != 0:
            raise UserError(
                f"model._target_={ctx.cfg.model._target_} with task=model_loss returned "
                f"{type(out).__name__}, which holds no loss: return an object with a `.loss` "
                "scalar tensor, a dict with 'loss', or the scalar loss itself (compute it when "
                "the batch carries labels), or pick another task (e.g. `task=classification`)."
            )

    def forward(self, model: nn.Module, batch: Any) -> Any:
        return call(model, batch)

    def step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return loss_of(call(model, batch))


def _shape(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return "dict with keys " + ", ".join(map(str, batch))
    if isinstance(batch, list | tuple):
        return f"{type(batch).__name__} of {len(batch)}"
    return type(batch).__name__
