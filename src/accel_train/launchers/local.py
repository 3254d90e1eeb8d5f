"""`launcher=local` (the default): train in this process. Asking for more processes
(nproc_per_node or nnodes above 1) starts them under torchrun, as launcher=torchrun would."""

from __future__ import annotations

from omegaconf import DictConfig

from accel_train.config.schema import LauncherConfig
from accel_train.environment import inside_torchrun
from accel_train.launchers.torchrun import Torchrun
from accel_train.plugins import register_launcher


@register_launcher("local", LauncherConfig)
class Local(Torchrun):
    in_process_when_alone = True

    def adopt_srun_task(self, cfg: DictConfig) -> None:
        super().adopt_srun_task(cfg)
        if not inside_torchrun() and str(cfg.launcher.nnodes) != "1":
            # One node agent of several: it starts torchrun, and config.yaml says so.
            cfg.launcher.name = "torchrun"
