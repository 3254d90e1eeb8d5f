"""task=language_model: next-token prediction. A batch is `(inputs, targets)`, token ids of
shape (batch, time), the targets the inputs shifted by one (`dataset=tokens` makes them); the
model maps ids to logits (batch, time, vocab).

The step returns the *summed* token cross-entropy and the number of target tokens (targets of
`ignore_index` do not count), so the loop's normaliser divides once by the tokens of the whole
accumulated and all-reduced batch. Validation logs the mean token loss and its perplexity."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from accel_train.errors import UserError
from accel_train.tasks.base import Task, TaskContext


class LanguageModel(Task):
    name = "language_model"
    generates_text = True

    def __init__(self, ignore_index: int = -1):
        super().__init__()
        self.ignore_index = ignore_index

    @classmethod
    def metric_modes(cls, cfg: DictConfig) -> dict[str, str]:
        return {"loss": "min", "ppl": "min"}

    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)
        batch = ctx.prepared(self)
        if not (isinstance(batch, list | tuple) and len(batch) == 2):
            raise UserError(
                f"task=language_model: a batch is {type(batch).__name__}, but it needs (inputs, "
                "targets) pairs of token ids, e.g. from `dataset=tokens`."
            )
        x, y = batch
        was = ctx.model.training
        ctx.model.eval()
        try:
            with torch.no_grad():
                logits = ctx.model(x)
        finally:
            ctx.model.train(was)
        if not isinstance(logits, torch.Tensor) or logits.shape[:2] != y.shape:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)
            raise UserError(
                f"model._target_={ctx.cfg.model._target_} with task=language_model returned "
                f"{got} for token ids of shape {tuple(x.shape)}; it must return logits of shape "
                "(batch, time, vocab)."
            )

    def inputs(self, batch: Any) -> torch.Tensor:
        return batch[0]

    def step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = model(x)
        # fp32 cross-entropy (under autocast too), summed: the loop divides by the tokens.
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(),
            y.flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        return loss, (y != self.ignore_index).sum()

    def derived(self, metrics: dict[str, float]) -> dict[str, float]:
        """Perplexity from the mean token loss (a mean of perplexities would be wrong)."""
        if "loss" in metrics:
            metrics["ppl"] = math.exp(min(metrics["loss"], 50.0))
        return metrics
