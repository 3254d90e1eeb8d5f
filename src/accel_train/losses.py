"""The loss by ``_target_``: torch's CrossEntropyLoss by default, or the user's own module,
called as ``loss(logits, targets)`` -> the batch's mean loss."""

from __future__ import annotations

import inspect

from omegaconf import DictConfig
from torch import nn

from accel_train.targets import build, locate


def build_loss(lc: DictConfig, num_classes: int, reduction: str | None = None) -> nn.Module | None:
    """The loss. With `reduction` (e.g. "none" for per-sample losses): built with that
    argument, or None when the loss's constructor takes no `reduction`."""
    runtime: dict[str, object] = {"num_classes": num_classes}
    if reduction is not None:
        try:
            params = inspect.signature(locate(str(lc._target_), "loss._target_")).parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            if "reduction" not in params and not takes_any:
                return None
        except (TypeError, ValueError):  # no signature to read: try it
            pass
        runtime["reduction"] = reduction
    return build(lc, "loss", runtime=runtime)
