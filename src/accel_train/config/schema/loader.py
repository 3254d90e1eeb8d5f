"""loader: how batches reach the device (accel_train/data/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class LoaderConfig:
    name: str = MISSING
    # An int >= 1, or "auto" (probed before training: train/auto_batch.py); checked in
    # config/checks.py, since OmegaConf 2.3 has no int-or-str type.
    batch_size: Any = 64
    max_batch_size: int = 1024
    eval_batch_size: int = 0
    drop_last: bool = False
    shuffle: bool = True


@dataclass
class TorchLoaderConfig(LoaderConfig):
    num_workers: int = 0
    pin_memory: bool = True
    persistent_workers: bool = True
    prefetch_factor: int = 2
    multiprocessing_context: str | None = None


@dataclass
class RayLoaderConfig(LoaderConfig):
    num_workers: int = 2
    cpus_per_worker: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)
    address: str | None = None
    prefetch: int = 4
    max_restarts: int = 3
    retries: int = 3
    timeout_s: float = 120.0
    object_store_mb: int | None = None
    runtime_env: dict[str, Any] = field(default_factory=dict)
    pin_memory: bool = True
