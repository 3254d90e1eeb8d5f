"""strategy: how the model is spread over the processes (accel_train/strategies/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class StrategyConfig:
    name: str = MISSING
    backend: str = "auto"


@dataclass
class DdpConfig(StrategyConfig):
    bucket_cap_mb: int = 25
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False


@dataclass
class FsdpConfig(StrategyConfig):
    reshard_after_forward: bool = True
    wrap_classes: list[str] = field(default_factory=list)
    tp: int = 1
    sequence_parallel: bool = False
    tp_plan: dict[Any, str] = field(default_factory=dict)  # int keys: a Sequential's layers
    cp: int = 1


@dataclass
class TpConfig(StrategyConfig):
    tp: int = 0
    sequence_parallel: bool = False
    tp_plan: dict[Any, str] = field(default_factory=dict)  # int keys: a Sequential's layers


@dataclass
class PipelineConfig(StrategyConfig):
    stages: int = 0
    schedule: str = "1f1b"
    microbatches: int = 4
    split_points: list[str] = field(default_factory=list)
