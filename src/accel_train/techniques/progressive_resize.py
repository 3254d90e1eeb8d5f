"""trainer.progressive_resize: FFCV's progressive resizing (its ImageNet example's
``get_resolution``): small training images in the first epochs, growing to the final size.

The sizes themselves are drawn in the loader workers: the training split's ``size_at`` hook
(data/images/sample_recipe.py :class:`ProgressiveSizes`, set when the data is built) gives each
sample its epoch's side, and the batches of one epoch all share it. The crops stay seeded by (seed,
epoch, index), so a mid-epoch resume gives the same images. Evaluation keeps its own size. This
technique says in the log which size each epoch trains at (host ints, no device read), and
that the schedule, not ``dataset.image_size``, sets the training size. Before training it runs
the model once at every size the schedule will use (two real samples, resized; no gradient),
so a model that cannot take one is refused then, not after epoch 0 with a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from accel_train.errors import UserError
from accel_train.techniques import PREPARE, BuildContext, Technique

log = logging.getLogger("accel_train")


class ProgressiveResize(Technique):
    name = "progressive_resize"
    order = PREPARE  # the probe runs on the bare model, before any wrapper or compile

    def __init__(self, sizes, image_size: int | None = None, max_epochs: int = 1):
        # epoch -> training image side (data/images/sample_recipe.py ProgressiveSizes)
        self.sizes = sizes
        self.image_size = image_size  # dataset.image_size, which the schedule overrides
        self.max_epochs = max_epochs
        self.logged: int | None = None  # the epoch last announced

    def used_sizes(self) -> dict[int, int]:
        """{size: the first epoch that trains at it} for the epochs the run can reach (the
        schedule is constant from end_epoch on)."""
        first: dict[int, int] = {}
        for epoch in range(min(self.max_epochs, self.sizes.end_epoch + 1)):
            first.setdefault(self.sizes(epoch), epoch)
        return first

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        sample = ctx.sample
        if not isinstance(sample, torch.Tensor) or sample.dim() != 4:
            return model  # (image batches only: the loader refuses the schedule otherwise)
        was_training = model.training
        model.eval()  # no BatchNorm statistics updated by the probe
        try:
            for size, epoch in self.used_sizes().items():
                x = torch.nn.functional.interpolate(sample.float(), size=(size, size))
                try:
                    with torch.no_grad():
                        model(x.to(sample.dtype))
                except Exception as err:  # noqa: BLE001 - any failure: refused, named
                    raise UserError(self._refusal(size, epoch, err)) from None
        finally:
            model.train(was_training)
        return model

    def _refusal(self, size: int, epoch: int, err: Exception) -> str:
        reason = " ".join(str(err).split())[:300]
        return (
            f"trainer.progressive_resize trains at {size} px from epoch {epoch}, and the model "
            f"fails on images of that size ({type(err).__name__}: {reason}). Every size the "
            f"schedule uses ({', '.join(map(str, self.used_sizes()))} px) must fit the model: "
            "change the schedule's start_size/end_size/step, or use a model that takes any "
            "size (a CNN; a timm ViT with `+model.dynamic_img_size=true`, which model=timm sets "
            "for you where timm takes it)."
        )

    def on_fit_start(self, loop: Any) -> None:
        s = self.sizes
        if loop.env.is_main:
            log.info(
                "progressive_resize: training images %d px up to epoch %d, %d px from epoch %d "
                "(between them rounded to a multiple of %d, FFCV's schedule; epochs from 0); "
                "evaluation unchanged",
                s.start_size, s.start_epoch, s.end_size, s.end_epoch, s.step,
            )  # fmt: skip
            if self.image_size is not None:
                # A warning where the user asked for smaller images than any the schedule
                # trains at (+experiment=imagenet_resnet50 dataset.image_size=32: 160 px).
                small = self.image_size < min(self.used_sizes())
                said = log.warning if small else log.info
                said(
                    "progressive_resize: the schedule sets the training size, not "
                    "dataset.image_size=%s (which evaluation keeps, with eval_image_size)",
                    self.image_size,
                )
        self._announce(loop)

    def on_train_step_end(self, loop: Any) -> None:
        if loop.epoch != self.logged:  # host ints: the first step of a new epoch
            self._announce(loop)

    def _announce(self, loop: Any) -> None:
        self.logged = loop.epoch
        if loop.env.is_main:
            log.info(
                "progressive_resize: epoch %d trains at %d px", loop.epoch, self.sizes(loop.epoch)
            )

    def summary(self, loop: Any) -> dict[str, Any]:
        return {"progressive_resize": {"last_size": self.sizes(loop.epoch)}}
