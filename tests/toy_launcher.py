"""A launcher as a developer adds one (docs/architecture.md): this file, one registry line
(`LAUNCHERS["toy"] = ToyLauncher`, which tests/test_toy_launcher.py runs before the CLI) and its
option, launcher/toy.yaml. It trains in this process, as launcher=local does, and leaves a
marker that says it was the one that launched."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from accel_train.config.run_config import write_run_config
from accel_train.launchers.base import Launcher
from accel_train.launchers.worker import run_worker
from accel_train.launchers.world import check_strategy

MARKER = "launched_by_toy.txt"

# The option's file, for a config folder on Hydra's search path.
OPTION_YAML = """\
defaults:
  - launcher_schema
  - _self_
name: toy
"""


class ToyLauncher(Launcher):
    def planned_world_size(self, cfg: DictConfig) -> int:
        return 1

    def launch(self, cfg: DictConfig) -> float | None:
        check_strategy(cfg, self.planned_world_size(cfg))
        run_dir = Path(cfg.paths.output_dir)
        write_run_config(cfg, run_dir)
        (run_dir / MARKER).write_text(f"{os.getpid()}\n")
        return run_worker(cfg).get(cfg.objective)
