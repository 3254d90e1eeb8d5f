"""The loss by ``_target_``: torch's CrossEntropyLoss by default, or the user's own module,
called as ``loss(logits, targets)`` -> the batch's mean loss."""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn

from accel_train.targets import build


def build_loss(lc: DictConfig, num_classes: int) -> nn.Module:
    return build(lc, "loss", runtime={"num_classes": num_classes})
