"""paths: where data, logs and outputs go."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING


@dataclass
class PathsConfig:
    name: str = "default"
    data_dir: str = MISSING
    log_dir: str = MISSING
    output_dir: str = MISSING
