"""Where this process runs (a torchrun worker? a SLURM job or srun step?), read from environment
variables only, and the config resolvers that depend on it. Imports no torch: the CLI loads this
before Hydra composes, so a typo in an override fails in well under a second."""

from __future__ import annotations

import os
from datetime import datetime

from omegaconf import OmegaConf

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def inside_torchrun() -> bool:
    """True in a process started by torchrun (or anything that sets its variables)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def in_allocation() -> bool:
    return "SLURM_JOB_ID" in os.environ


def in_srun_step() -> bool:
    """A task started by srun (the batch script itself has no SLURM_STEP_ID)."""
    return in_allocation() and "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ


def run_stamp(rdzv_id: str | None, nnodes: str) -> str:
    """The last part of the run dir: a timestamp, or an id that every node and rank shares."""
    if str(nnodes) != "1" and rdzv_id:
        return str(rdzv_id)
    if inside_torchrun() and os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun_{os.environ['TORCHELASTIC_RUN_ID']}"
    if in_srun_step():  # `srun accel-train ...`: every task must find the same dir
        return f"slurm_{os.environ['SLURM_JOB_ID']}_{os.environ['SLURM_STEP_ID']}"
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")


def node_suffix(node_rank: int, nnodes: str) -> str:
    """Nodes share a run dir: node 0 writes train.log and .hydra/, node k train.node<k>.log..."""
    return "" if str(nnodes) == "1" or int(node_rank) == 0 else f".node{node_rank}"


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("node_suffix", node_suffix, replace=True)
