"""Process-group setup/teardown and the training device: the low layer every strategy
(accel_train/strategies/), technique and the loop stand on. The strategies wrap the model."""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from accel_train.environment import inside_torchrun
from accel_train.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()


def resolve_device(
    requested: str, local_rank: int = 0, key: str = "trainer.device"
) -> torch.device:
    """`key`: the device's key as the command spells it (accel-sample's is `device`)."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"{key}=cuda but this machine has no usable CUDA device "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False). "
            f"Use `{key}=cpu` or `{key}=auto`."
        )
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise UserError(
            f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}. "
            "Set `launcher.nproc_per_node` to at most the number of GPUs (or `auto`)."
        )
    return torch.device("cuda", local_rank)


@contextlib.contextmanager
def process_group(
    device_request: str, backend: str = "auto", timeout_s: float = 600.0
) -> Iterator[DistEnv]:
    """World size 1 in-process, or join the torchrun group; always torn down on the way out."""
    if not inside_torchrun():
        yield DistEnv(0, 0, 1, resolve_device(device_request))
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = resolve_device(device_request, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError(
            "strategy.backend=nccl needs CUDA devices but this rank trains on the CPU. Use "
            "`strategy.backend=gloo` (or `auto`)."
        )
    if dist.is_initialized():
        # Ray Train built the group before calling the worker (from the same RANK/WORLD_SIZE/
        # MASTER_* variables): join it; its owner tears it down.
        yield _existing_group(backend, local_rank, device)
        gc.collect()
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    # torchrun keeps its store across elastic restarts; without a per-attempt prefix a restarted
    # group reads the dead workers' addresses and gloo's connect times out.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"accel_train/attempt_{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    try:
        yield DistEnv(rank, local_rank, world, device)
    finally:
        # Whatever still refers to the group (a DDP reducer, an FSDP state, a pipeline stage)
        # must be collected before it is destroyed: left to the interpreter's finalisation,
        # gloo's worker threads are torn down in no particular order and the process aborts
        # ("terminate called without an active exception") after its work is done.
        gc.collect()
        dist.destroy_process_group()


def _existing_group(backend: str, local_rank: int, device: torch.device) -> DistEnv:
    if dist.get_backend() != backend:
        raise UserError(
            f"strategy.backend={backend} but the process group this worker was given uses "
            f"{dist.get_backend()}. Set `strategy.backend={dist.get_backend()}` (or `auto`)."
        )
    return DistEnv(dist.get_rank(), local_rank, dist.get_world_size(), device)
