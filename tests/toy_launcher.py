"""A launcher as a third-party package adds one (docs/architecture.md): this file, registered by
its decorator, and an `accel_train.plugins` entry point naming it (tests/test_toy_extensions.py
installs both in a package of its own). It trains in this process, as launcher=local does, and
leaves a marker that says it was the one that launched. No YAML: its dataclass is the option."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from accel_train.config.run_config import write_run_config
from accel_train.config.schema import LauncherConfig
from accel_train.launchers.base import Launcher
from accel_train.launchers.worker import run_worker
from accel_train.launchers.world import check_strategy
from accel_train.plugins import register_launcher

MARKER = "launched_by_toy.txt"


@register_launcher("toy", LauncherConfig)
class ToyLauncher(Launcher):
    def planned_world_size(self, cfg: DictConfig) -> int:
        return 1

    def launch(self, cfg: DictConfig) -> float | None:
        check_strategy(cfg, self.planned_world_size(cfg))
        run_dir = Path(cfg.paths.output_dir)
        write_run_config(cfg, run_dir)
        (run_dir / MARKER).write_text(f"{os.getpid()}\n")
        return run_worker(cfg).get(cfg.objective)
