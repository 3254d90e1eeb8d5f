"""The techniques' groups (quant, distill, prune, selective_backprop, ema, lora,
activation_checkpointing; accel_train/techniques/): one typed group each, off at their neutral
value. Small groups of one or two dataclasses, kept in one module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class QuantConfig:
    name: str = MISSING


@dataclass
class QatConfig(QuantConfig):
    weight_bits: int = 8
    group_size: int = 0


@dataclass
class DistillConfig:
    name: str = "default"
    # A teacher checkpoint path (.pt, or an FSDP .dcp dir), or a model node with a _target_.
    teacher: Any = None
    alpha: float = 0.5
    temperature: float = 4.0


@dataclass
class PruneScheduleConfig:
    start: float = 0.0
    end: float = 0.8
    ramp: str = "cubic"
    every_n_steps: int = 10


@dataclass
class PruneConfig:
    name: str = "default"
    amount: float = 0.0
    method: str = "unstructured"
    scope: str = "global"
    schedule: PruneScheduleConfig = field(default_factory=PruneScheduleConfig)


@dataclass
class SelectiveBackpropConfig:
    name: str = "default"
    keep: float = 1.0
    start: float = 0.5
    end: float = 0.9
    interrupt: int = 2


@dataclass
class EmaConfig:
    name: str = "default"
    enabled: bool = False
    decay: float = 0.999
    every_n_steps: int = 1
    start_step: int = 0
    warmup: bool = True


@dataclass
class LoraConfig:
    name: str = "default"
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target: list[str] = field(default_factory=list)
    base_dtype: str | None = None


@dataclass
class ActivationCheckpointingConfig:
    name: str = "default"
    mode: str = "off"
    every: int = 2
    classes: list[str] = field(default_factory=list)
    offload: bool = False
