"""`launcher=torchrun`: the workers on this node start under torchrun (torch.distributed.run):
multi-process, multi-node (each node runs `accel-train` with its node_rank), elastic."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from omegaconf import DictConfig

from accel_train.config.run_config import write_run_config
from accel_train.config.schema import LauncherConfig
from accel_train.console import print_startup
from accel_train.environment import in_srun_step, inside_torchrun
from accel_train.launchers.base import Launcher
from accel_train.launchers.slurm_job import adopt_srun_task
from accel_train.launchers.startup_tree import launch_tree
from accel_train.launchers.torchrun_process import run_torchrun
from accel_train.launchers.worker import run_worker
from accel_train.launchers.world import check_strategy, local_world_size
from accel_train.plugins import register_launcher
from accel_train.train.found import forget as forget_checkpoint

log = logging.getLogger("accel_train")


@register_launcher("torchrun", LauncherConfig)
class Torchrun(Launcher):
    # One process on one node trains in this process, without torchrun (launcher=local).
    in_process_when_alone = False

    def planned_world_size(self, cfg: DictConfig) -> int | None:
        if in_srun_step() or not str(cfg.launcher.nnodes).isdigit():
            return None
        return local_world_size(cfg) * int(cfg.launcher.nnodes)

    def adopt_srun_task(self, cfg: DictConfig) -> None:
        adopt_srun_task(cfg)

    def launch(self, cfg: DictConfig) -> float | None:
        run_dir = Path(cfg.paths.output_dir)
        if in_srun_step() and not inside_torchrun():
            self.adopt_srun_task(cfg)
        nproc, nnodes = local_world_size(cfg), cfg.launcher.nnodes
        check_strategy(cfg, nproc, keys=self.world_keys(cfg))
        if inside_torchrun():
            # Started by the user's own torchrun (or srun): this process *is* a worker.
            if int(os.environ["RANK"]) == 0:
                write_run_config(cfg, run_dir)
            return run_worker(cfg).get(cfg.objective)
        # Nodes of a multi-node run share the run dir: each writes config.node<k>.yaml, and
        # global rank 0 writes config.yaml once all ranks agree on it (train/agreement.py).
        multi_node = str(nnodes) != "1"
        name = f"config.node{cfg.launcher.node_rank}.yaml" if multi_node else "config.yaml"
        path = write_run_config(cfg, run_dir, name)
        if cfg.trainer.progress != "none":
            print_startup(launch_tree(cfg))
        log.info("run dir: %s", run_dir)
        if self.in_process_when_alone and nproc == 1 and not multi_node:
            return run_worker(cfg).get(cfg.objective)
        forget_checkpoint()  # the workers read it themselves: this process keeps no copy
        run_torchrun(cfg, path, nproc)
        summary = run_dir / "summary.json"  # written by global rank 0, possibly on another node
        return json.loads(summary.read_text()).get(cfg.objective) if summary.is_file() else None
