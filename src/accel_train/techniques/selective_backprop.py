"""selective_backprop: train on the hardest samples of each batch (Jiang et al., 2019, "Accelerating
Deep Learning by Focusing on the Biggest Losers"; MosaicML Composer's SelectiveBackprop).

On a selected micro-batch the batch is first scored in a forward pass without gradients (the
per-sample loss, ``reduction="none"``), then the ``round(keep * batch)`` samples with the highest
loss go through the normal forward and backward. A fixed count (``torch.topk``), not a loss
threshold, keeps every selected micro-batch the same shape, so ``torch.compile`` does not
recompile and nothing waits for the device. Each DDP rank selects from its own shard (no
collective); every rank runs the same two forwards, so DDP's collectives stay matched.

When: optimizer steps in ``[start, end)`` (fractions of the run), except that every
``interrupt``-th step trains on the full batch (Composer's ``interrupt``; 0 = never).

The loop's ``train/loss`` on a selected step is the mean over the kept (hardest) samples, so it
reads higher than on a full step. The scoring pass runs the model in training mode, as Composer
does: dropout is active and batch-norm running statistics see that pass too.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from accel_train.data.batch import count_samples, select
from accel_train.techniques import PREPARE, BuildContext, LossFn, Technique

log = logging.getLogger("accel_train")


class SelectiveBackprop(Technique):
    name = "selective_backprop"
    order = PREPARE  # its transform only checks the loss, before anything is wrapped

    def __init__(self, keep: float, start: float, end: float, interrupt: int):
        self.keep, self.start, self.end, self.interrupt = keep, start, end, interrupt
        self.per_sample: Any = None  # (model, batch) -> per-sample losses, from the task
        # Host-side counts (no device reads): selected micro-batches, samples kept / seen there.
        self.selected = self.kept = self.seen = 0
        self.loop: Any = None

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        """Start-up check: the task must score each sample alone (for classification, the loss
        rebuilt with `reduction="none"`); it raises the UserError naming what is missing."""
        self.per_sample = ctx.task.per_sample()
        return model

    def on_fit_start(self, loop: Any) -> None:
        self.loop = loop
        total = loop.parts.total_steps
        # Optimizer steps (0-based, the one being computed) where selection applies.
        self.first, self.last = round(self.start * total), round(self.end * total)
        if loop.env.is_main:
            log.info(
                "selective_backprop: keep %d of every %d samples on optimizer steps %d-%d%s",
                round(self.keep * loop.cfg.loader.batch_size),
                loop.cfg.loader.batch_size,
                self.first + 1,
                self.last,
                f" (the full batch on multiples of {self.interrupt})" if self.interrupt else "",
            )

    def _active(self) -> bool:
        step = self.loop.step  # host int: the optimizer step this micro-batch belongs to
        if not self.first <= step < self.last:
            return False
        return self.interrupt == 0 or (step + 1) % self.interrupt != 0

    def wrap_loss(self, loop: Any, compute: LossFn) -> LossFn:
        scorer = loop.eval_model  # under DDP the bare module: no buffer broadcast, no reducer

        def selective(batch: Any) -> Any:
            if self.loop is None or not self._active():
                return compute(batch)
            n = count_samples(batch)
            k = max(1, round(self.keep * n))
            with torch.no_grad():
                losses = self.per_sample(scorer, batch)
            idx = torch.topk(losses.float(), k, sorted=False).indices  # on the device
            self.selected += 1
            self.kept += k
            self.seen += n
            return compute(select(batch, idx))

        return selective

    def on_log(self, loop: Any, metrics: dict[str, float]) -> None:
        metrics["selective_backprop/kept_fraction"] = self.kept / self.seen if self.seen else 1.0

    def summary(self, loop: Any) -> dict[str, Any]:
        return {
            "selective_backprop": {
                "keep": self.keep,
                "selected_batches": self.selected,
                "kept_samples": self.kept,
                "seen_samples": self.seen,
            }
        }

    def state_dict(self) -> dict[str, Any]:
        return {"selected": self.selected, "kept": self.kept, "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.selected = int(state.get("selected", 0))
        self.kept, self.seen = int(state.get("kept", 0)), int(state.get("seen", 0))
