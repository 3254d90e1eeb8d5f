"""loss: a class by `_target_`."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING


@dataclass
class LossConfig:
    _target_: str = MISSING
    name: str = "custom"


@dataclass
class CrossEntropyConfig(LossConfig):
    label_smoothing: float = 0.0
