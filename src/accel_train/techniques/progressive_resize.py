"""trainer.progressive_resize: FFCV's progressive resizing (its ImageNet example's
``get_resolution``): small training images in the first epochs, growing to the final size.

The sizes themselves are drawn in the loader workers: the training split's ``size_at`` hook
(data/recipe.py :class:`ProgressiveSizes`, set when the data is built) gives each sample its
epoch's side, and the batches of one epoch all share it. The crops stay seeded by (seed, epoch,
index), so a mid-epoch resume gives the same images. Evaluation keeps its own size. This
technique only says in the log which size each epoch trains at (host ints, no device read).
"""

from __future__ import annotations

import logging
from typing import Any

from accel_train.techniques import Technique

log = logging.getLogger("accel_train")


class ProgressiveResize(Technique):
    name = "progressive_resize"

    def __init__(self, sizes):
        self.sizes = sizes  # epoch -> training image side (data/recipe.py ProgressiveSizes)
        self.logged: int | None = None  # the epoch last announced

    def on_fit_start(self, loop: Any) -> None:
        s = self.sizes
        if loop.env.is_main:
            log.info(
                "progressive_resize: training images %d px up to epoch %d, %d px from epoch %d "
                "(between them rounded to a multiple of %d, FFCV's schedule; epochs from 0); "
                "evaluation unchanged",
                s.start_size, s.start_epoch, s.end_size, s.end_epoch, s.step,
            )  # fmt: skip
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
