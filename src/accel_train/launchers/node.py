"""One node's torchrun agent inside a SLURM job: `python -m accel_train.node <config.yaml> ...`.

`srun` starts one per node (see launchers.slurm_job.render_sbatch); it takes its node rank and the
rendezvous from the command line, which each node's shell fills in from SLURM's variables.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from accel_train.config.run_config import load_run_config
from accel_train.errors import report_user_errors
from accel_train.launchers.slurm_job import processes_per_node
from accel_train.launchers.torchrun_process import run_torchrun


@report_user_errors
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m accel_train.node")
    parser.add_argument("config")
    parser.add_argument("--nnodes", required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--rdzv-endpoint", required=True)
    parser.add_argument("--rdzv-id", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][node %(process)d] %(message)s")
    cfg = load_run_config(args.config)
    lc = cfg.launcher
    lc.nnodes, lc.node_rank = str(args.nnodes), args.node_rank
    lc.rdzv_endpoint, lc.rdzv_id = args.rdzv_endpoint, args.rdzv_id
    run_torchrun(cfg, Path(args.config), processes_per_node(lc))
