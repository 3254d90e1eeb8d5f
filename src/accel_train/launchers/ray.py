"""`launcher=ray`: Ray Train's TorchTrainer starts the workers (launchers/ray_train.py); this
process drives the run, or submits a driver through Ray's Jobs API and exits (submit=job)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from accel_train.config.schema import RayLauncherConfig
from accel_train.launchers import ray_train
from accel_train.launchers.base import Launcher
from accel_train.launchers.world import check_strategy
from accel_train.plugins import register_launcher
from accel_train.strategies import WorldKeys


@register_launcher("ray", RayLauncherConfig)
class Ray(Launcher):
    def check(self, cfg: DictConfig) -> None:
        ray_train.check(cfg.launcher)

    def planned_world_size(self, cfg: DictConfig) -> int:
        return ray_train.planned_world_size(cfg.launcher)

    def world_keys(self, cfg: DictConfig) -> WorldKeys:
        n = cfg.launcher.num_workers
        return WorldKeys(
            f"launcher.num_workers={n}", "launcher.num_workers", "launcher.num_workers=1"
        )

    def submits_and_exits(self, cfg: DictConfig) -> bool:
        return cfg.launcher.submit == "job"

    def launch(self, cfg: DictConfig) -> float | None:
        check_strategy(cfg, self.planned_world_size(cfg), keys=self.world_keys(cfg))
        return ray_train.launch(cfg, Path(cfg.paths.output_dir))
