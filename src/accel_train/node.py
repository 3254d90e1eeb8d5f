"""One node's torchrun agent inside a SLURM job: `python -m accel_train.node <config.yaml> ...`.

`srun` starts one per node (see slurm.render_sbatch). The agent passes SIGUSR1 (SLURM's warning
before the time limit, or `scancel --signal=USR1`) on to its workers, which checkpoint at the next
step boundary and requeue the job.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from accel_train.cli import report_user_errors
from accel_train.config import load_run_config


def child_pids(parent: int) -> list[int]:
    """PIDs whose parent is `parent` (torchrun starts workers in their own sessions, so a
    process-group signal would not reach them)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            pids.append(int(entry.name))
    return pids


def forward_to_workers(signum, frame) -> None:
    for pid in child_pids(os.getpid()):
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.kill(pid, signum)


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
    signal.signal(signal.SIGUSR1, forward_to_workers)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from accel_train.slurm import processes_per_node
    from accel_train.torchrun import run_torchrun

    try:
        run_torchrun(cfg, Path(args.config), processes_per_node(lc))
    except SignalException as err:
        # SLURM ends the step with SIGTERM when the job is requeued or cancelled.
        logging.info("node agent stopped by %s", err.sigval.name)
        sys.exit(128 + err.sigval.value)


if __name__ == "__main__":
    main(sys.argv[1:])
