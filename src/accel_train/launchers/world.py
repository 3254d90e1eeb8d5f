"""The world a launch plans on this node: how many processes, and whether the strategy accepts
that many (checked before anything is started or written)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from accel_train.errors import UserError
from accel_train.parallel import resolve_device
from accel_train.strategies import WorldKeys, strategy_for


def local_world_size(cfg: DictConfig) -> int:
    """Processes on this node; checks `nproc_per_node` against the GPUs when training on CUDA."""
    lc, want = cfg.launcher, str(cfg.launcher.nproc_per_node)
    on_cuda = cfg.trainer.device == "cuda" or (
        cfg.trainer.device == "auto" and torch.cuda.is_available()
    )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.trainer.device == "cuda" and not gpus:
        resolve_device("cuda")  # raises: names trainer.device=cuda and the fix
    if want == "auto":
        return max(gpus, 1) if on_cuda else 1
    try:
        nproc = int(want)
    except ValueError:
        raise UserError(
            f"launcher.nproc_per_node={lc.nproc_per_node!r} is not a number or `auto`."
        ) from None
    if nproc < 1:
        raise UserError(f"launcher.nproc_per_node={nproc} must be >= 1 (or `auto`).")
    if on_cuda and nproc > gpus:
        raise UserError(
            f"launcher.nproc_per_node={nproc} but this node has {gpus} GPU(s). Use "
            f"`launcher.nproc_per_node={gpus}` or `auto`, or train on the CPU with "
            "`trainer.device=cpu` (gloo)."
        )
    return nproc


def check_strategy(
    cfg: DictConfig, nproc: int, nodes: int | None = None, keys: WorldKeys | None = None
) -> None:
    """The strategy's refusals for `nproc` processes on each of the nodes, before any starts:
    its layout (every mesh degree divides the world, a TP degree the heads), its own limits.
    `keys`: the launcher's own keys for the processes, which the refusals name."""
    sc, nnodes = cfg.strategy, str(nodes or cfg.launcher.nnodes)
    world = nproc * int(nnodes) if nnodes.isdigit() else None
    strategy = strategy_for(cfg)
    strategy.keys = keys or WorldKeys()
    strategy.check_world(world, nproc, nnodes)
    if sc.backend == "nccl" and not torch.cuda.is_available():
        raise UserError(
            "strategy.backend=nccl but this machine has no CUDA device; NCCL only runs on GPUs. "
            "Use `strategy.backend=gloo` (or `auto`, which picks gloo on the CPU)."
        )


def node_keys(lc: DictConfig) -> WorldKeys:
    """The keys of a launcher that allocates whole nodes (launcher.nodes x the processes of
    each: launcher.gpus_per_node when set, else launcher.nproc_per_node): SLURM, Kubernetes."""
    per_node = "gpus_per_node" if lc.gpus_per_node > 0 else "nproc_per_node"
    value = lc[per_node]
    return WorldKeys(
        f"launcher.nodes={lc.nodes} and launcher.{per_node}={value}",
        f"launcher.{per_node} (x launcher.nodes)",
        f"launcher.nodes=1 launcher.{per_node}=1",
    )
