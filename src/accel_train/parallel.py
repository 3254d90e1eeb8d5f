"""Process-group setup/teardown, the training device, and the DDP / FSDP model wrappers.

FSDP shards the model in units: the modules named by ``strategy.wrap_classes`` (class names),
or by default the outermost repeated blocks: every outermost module that has sub-modules, holds
parameters and whose class occurs at least twice (a ResNet's stages, a transformer's blocks);
a model with no such blocks (a flat Sequential) is sharded by its repeated layers instead. Then
the root. Each unit is one all-gather in forward and one reduce-scatter in backward."""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from accel_train.environment import inside_torchrun
from accel_train.errors import UserError
from accel_train.mesh import build_mesh, tp_degree
from accel_train.tensor_parallel import apply_tp

log = logging.getLogger(__name__)

# Strategies whose checkpoints are sharded directories (torch.distributed.checkpoint, .dcp).
SHARDED_STRATEGIES = ("fsdp", "pipeline", "tp")


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


def wrap_model(model: nn.Module, strategy_cfg: DictConfig, env: DistEnv) -> nn.Module:
    """Apply the parallelism strategy; returns the module the training step calls."""
    if strategy_cfg.name == "single" or not env.distributed:
        return model
    assert strategy_cfg.name != "pipeline", "pipeline.build_pipeline cuts the model"
    mesh = build_mesh(strategy_cfg, env.device.type, env.world_size)
    if strategy_cfg.name == "ddp":
        return DistributedDataParallel(
            model,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            process_group=mesh["dp_replicate"].get_group(),
            bucket_cap_mb=strategy_cfg.bucket_cap_mb,
            gradient_as_bucket_view=strategy_cfg.gradient_as_bucket_view,
            static_graph=strategy_cfg.static_graph,
            find_unused_parameters=strategy_cfg.find_unused_parameters,
        )
    if strategy_cfg.name == "tp":
        return apply_tp(model, mesh["tp"], strategy_cfg)
    assert strategy_cfg.name == "fsdp", strategy_cfg.name
    if tp_degree(strategy_cfg, env.world_size) > 1:
        # FSDP x TP: the layers are sharded over `tp` first, then FSDP shards those shards
        # over `dp_shard` (torchtitan's 2-D layout).
        apply_tp(model, mesh["tp"], strategy_cfg)
    shard_mesh = mesh["dp_shard"]
    reshard = strategy_cfg.reshard_after_forward
    for unit in shard_units(model, list(strategy_cfg.wrap_classes)):
        fully_shard(unit, mesh=shard_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=shard_mesh, reshard_after_forward=reshard)
    return model


def shard_units(model: nn.Module, wrap_classes: list[str]) -> list[nn.Module]:
    """The sub-modules FSDP shards one by one (see the module docstring for the policy)."""
    if wrap_classes:
        names = {c.rsplit(".", 1)[-1] for c in wrap_classes}
        wanted = lambda m: type(m).__name__ in names  # noqa: E731
        units = _outermost(model, wanted)
        if not units:
            found = sorted({type(m).__name__ for m in model.modules()})
            raise UserError(
                f"strategy.wrap_classes={wrap_classes}: the model has no module of those classes "
                f"(it has: {', '.join(found)}). Name classes from that list, or [] for the default."
            )
        return units
    counts = Counter(type(m) for m in model.modules() if m is not model)
    repeated = {cls for cls, n in counts.items() if n >= 2}

    def has_params(m: nn.Module) -> bool:
        # fully_shard needs a module with a forward: never a ModuleDict / ModuleList (PEFT's
        # lora_A and lora_B repeat in every adapted layer), whose owner is sharded instead.
        no_forward = isinstance(m, nn.ModuleDict | nn.ModuleList | nn.ParameterDict)
        return not no_forward and any(True for _ in m.parameters())

    def is_block(m: nn.Module) -> bool:
        return type(m) in repeated and has_params(m) and any(True for _ in m.children())

    blocks = _outermost(model, is_block)
    return blocks or _outermost(model, lambda m: type(m) in repeated and has_params(m))


def _outermost(model: nn.Module, wanted) -> list[nn.Module]:
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if wanted(child):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units
