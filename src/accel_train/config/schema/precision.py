"""precision: the dtype of the step and whether TF32 matmuls are allowed."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING


@dataclass
class PrecisionConfig:
    name: str = MISSING
    tf32: bool = True
