"""Every rank of a distributed run trains the same config: the ranks compare theirs once, at
start, and global rank 0 writes the run's config.yaml."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig

from accel_train.config.run_config import flatten, to_container, write_run_config
from accel_train.errors import UserError
from accel_train.parallel import DistEnv


def agree_on_config(cfg: DictConfig, env: DistEnv) -> None:
    """Every rank must train the same config (nodes compose their own); name the first
    difference. Then global rank 0 writes the run's config.yaml."""
    mine = flatten(to_container(cfg))
    mine.pop("launcher.node_rank", None)  # the one key that differs between nodes by design
    gathered: list[dict | None] = [None] * env.world_size
    dist.all_gather_object(gathered, mine)
    for rank, theirs in enumerate(gathered):
        if theirs != gathered[0]:
            key = next(
                k
                for k in sorted(set(theirs) | set(gathered[0]))
                if theirs.get(k) != gathered[0].get(k)
            )
            raise UserError(
                f"the nodes disagree on the config: {key}={gathered[0].get(key)!r} on rank 0 but "
                f"{theirs.get(key)!r} on rank {rank}. Start every node with the same overrides "
                "(only launcher.node_rank may differ)."
            )
    if env.is_main:
        write_run_config(cfg, Path(cfg.paths.output_dir))
