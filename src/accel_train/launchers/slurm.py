"""`launcher=slurm`: submit the run as a SLURM batch job (submit.sbatch in the run dir; srun
starts one torchrun agent per node, launchers/node.py) and exit; the job trains later."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from accel_train.config.run_config import write_run_config
from accel_train.config.schema import SlurmLauncherConfig
from accel_train.environment import in_srun_step
from accel_train.errors import UserError
from accel_train.launchers import slurm_job
from accel_train.launchers.base import Launcher
from accel_train.launchers.world import check_strategy, node_keys
from accel_train.plugins import register_launcher
from accel_train.strategies import WorldKeys
from accel_train.train.found import forget as forget_checkpoint


@register_launcher("slurm", SlurmLauncherConfig)
class Slurm(Launcher):
    def planned_world_size(self, cfg: DictConfig) -> int:
        return slurm_job.processes_per_node(cfg.launcher) * int(cfg.launcher.nodes)

    def world_keys(self, cfg: DictConfig) -> WorldKeys:
        return node_keys(cfg.launcher)

    def submits_and_exits(self, cfg: DictConfig) -> bool:
        return True

    def launch(self, cfg: DictConfig) -> None:
        forget_checkpoint()  # the job's processes read it themselves
        if in_srun_step():
            raise UserError(
                "launcher=slurm inside an srun step would submit a job from every task. Inside "
                "an allocation call `srun accel-train ...` with launcher=local (the default), or "
                "run `accel-train launcher=slurm` once from the batch script or salloc shell."
            )
        lc = cfg.launcher
        check_strategy(cfg, slurm_job.processes_per_node(lc), lc.nodes, self.world_keys(cfg))
        if cfg.resume is None:
            cfg.resume = "auto"  # a requeued job lands in this run dir and continues
        path = write_run_config(cfg, Path(cfg.paths.output_dir))
        slurm_job.submit(cfg, path)
        return None
