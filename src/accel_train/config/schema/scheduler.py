"""scheduler: the learning-rate schedule (accel_train/optim/)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING


@dataclass
class SchedulerConfig:
    name: str = MISSING
    warmup_steps: int = 0
    warmup_epochs: float | None = None


@dataclass
class StepSchedulerConfig(SchedulerConfig):
    step_size: int = 1000
    step_epochs: float | None = None
    gamma: float = 0.1


@dataclass
class CosineSchedulerConfig(SchedulerConfig):
    min_lr: float = 0.0


@dataclass
class OneCycleSchedulerConfig(SchedulerConfig):
    max_lr: float = 0.01
    pct_start: float = 0.3
    anneal_strategy: str = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1.0e4
