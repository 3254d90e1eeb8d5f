"""optimizer: accel_train/optim/."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class OptimizerConfig:
    name: str = MISSING
    lr: float = 1e-3
    weight_decay: float = 0.0
    fused: bool | None = None
    scale_lr_with_batch: bool = False
    reference_batch_size: int = 256
    layer_decay: float | None = None  # timm's layer-wise lr decay (optim.py; issue 38)


@dataclass
class SgdConfig(OptimizerConfig):
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class AdamConfig(OptimizerConfig):
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class MuonConfig(OptimizerConfig):
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    ns_dtype: str = "auto"  # Newton-Schulz dtype: auto (bf16 where native, else fp32), bf16, fp32
    adamw_lr: float = 1e-3
    adamw_weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
