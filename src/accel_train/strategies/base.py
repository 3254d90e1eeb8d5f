"""What a parallelism strategy is: an object that answers the questions the launcher, the build,
the loop, resume and the techniques ask. None of them asks a strategy its name.

    before any process starts (the launcher)   check_world(world, nproc, nnodes)
                                               data_world(world): processes reading different data
    in each process (train/build.py)           data_coords(env), owns_forward_backward(env),
                                               wrap(module, env, sample, precision)
    in the loop                                forward_backward (when the strategy owns it: the
                                               pipeline schedule), before_optimizer_step,
                                               clip_grad_norm_, logged_samples, spread,
                                               sequence_shards, sequence_split
    checkpoints                                checkpoint_format (checkpoint_formats/: a .dcp
                                               directory or one file), optimizer_state_by_name
    techniques                                 shards_parameters, replicates_buffers
    tasks' refusals                            shards_parameters, runs_whole_model(cfg)

A strategy's layout (`layout(world)`) names the degrees of the run's one DeviceMesh (mesh.py).
The refusals keyed by a strategy's name (config/combinations.py) are a table of data.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from accel_train.checkpoint_formats import format_named
from accel_train.errors import UserError
from accel_train.parallel import DistEnv
from accel_train.precision import Precision
from accel_train.strategies.mesh import MeshLayout, build_mesh, check_heads


@dataclass(frozen=True)
class WorldKeys:
    """The launcher's own keys for the run's processes, as the strategies' refusals name them
    (the user's keys and values: `launcher.num_workers=3` under Ray, not torchrun's
    nproc_per_node). `given`: what they say now; `count`: the key(s) to change; `one`: the
    override for one process. The default is torchrun's, for a config checked without a
    launcher (a user's own torchrun, the workers)."""

    given: str = "launcher.nproc_per_node=1"
    count: str = "launcher.nproc_per_node (x launcher.nnodes)"
    one: str = "launcher.nproc_per_node=1"


@dataclass
class Wrapped:
    """What the loop trains (`model`) and what validation calls (`eval_model`); `module` is the
    plain model whose state_dict the checkpoints hold (a pipeline stage keeps only its blocks)."""

    model: nn.Module
    eval_model: nn.Module
    module: nn.Module


class Strategy:
    """The base: one process or plain data parallelism with nothing sharded."""

    name: ClassVar[str] = "strategy"
    # Distributed checkpoints are directories of shards (torch.distributed.checkpoint, .dcp).
    sharded_checkpoints: ClassVar[bool] = False
    # The optimizer state is keyed by parameter name, per stage (the pipeline's): a checkpoint
    # does not move between such a strategy and the others.
    optimizer_state_by_name: ClassVar[bool] = False
    # FSDP2 shards only contiguous parameters (channels_last converts the inputs only).
    shards_parameters: ClassVar[bool] = False
    # DDP broadcasts buffers from rank 0 in forward (pruning's masks are left out of it).
    replicates_buffers: ClassVar[bool] = False

    @classmethod
    def runs_whole_model(cls, cfg: Any) -> bool:
        """Whether each process runs the whole model on its own batch under the strategy group
        `cfg` (its parameters may be sharded at rest, as FSDP's): what sampling completions
        needs (task=grpo). Not where stages sit on different processes (a pipeline) or each
        layer is split across them (tensor parallelism)."""
        return True

    def __init__(self, run_cfg: DictConfig):
        self.run_cfg = run_cfg  # the run's whole config
        self.cfg = run_cfg.strategy  # its `strategy` group
        # Processes holding each data-parallel rank's loss (the TP group), as this process
        # trains: set by a tensor-parallel strategy's `wrap`.
        self.spread = 1
        # Processes holding parts of each batch's sequences (context parallelism): set by `wrap`.
        self.sequence_split = 1
        # How the launcher's keys give the processes, for the refusals of `check_world` and
        # `layout` (set by launchers/world.check_strategy before it asks).
        self.keys = WorldKeys()

    # ---- the layout -------------------------------------------------------------------------

    def tp_degree(self, world: int) -> int:
        """Processes of one tensor-parallel group (they hold the same batch and loss)."""
        return 1

    def layout(self, world: int) -> MeshLayout:
        """The mesh degrees of `world` processes; a UserError naming the key when impossible."""
        return MeshLayout(dp_replicate=world)

    def data_world(self, world: int | None) -> int | None:
        """How many of `world` processes read different data (None: not known yet)."""
        if world is None or world == 1:
            return world
        return self.layout(world).data_world

    def data_coords(self, env: DistEnv) -> tuple[int, int]:
        """(rank, world) of this process among those that read different data."""
        if not env.distributed or env.world_size == 1:
            return env.rank, env.world_size
        lay = self.layout(env.world_size)
        return lay.data_rank(env.rank), lay.data_world

    def check_world(self, world: int | None, nproc: int, nnodes: str) -> None:
        """Before any process starts (`world`: None when not known yet, e.g. nnodes=auto): every
        mesh degree divides the world, a TP degree the model's heads."""
        if world is None:
            return
        self.layout(world)
        cfg = self.run_cfg
        heads = cfg.model.get("n_head") if "model" in cfg else None
        check_heads(self.tp_degree(world), heads, "model.n_head")

    def mesh(self, env: DistEnv) -> DeviceMesh | None:
        return build_mesh(self.layout(env.world_size), env.device.type, env.world_size)

    # ---- the build --------------------------------------------------------------------------

    def wrap(self, module: nn.Module, env: DistEnv, sample: Any, precision: Precision) -> Wrapped:
        """Apply the strategy to the transformed model (once the process group exists)."""
        return Wrapped(module, module, module)

    # ---- the loop ---------------------------------------------------------------------------

    def checkpoint_format(self, distributed: bool) -> str:
        """The name of the format this strategy's checkpoints are written in
        (checkpoint_formats/): a sharded directory when the model is spread over processes."""
        return "dcp" if self.sharded_checkpoints and distributed else "file"

    def checkpoint_suffix(self, distributed: bool) -> str:
        return format_named(self.checkpoint_format(distributed)).suffix

    def owns_forward_backward(self, env: DistEnv) -> bool:
        """The strategy runs forward and backward itself (a pipeline schedule, the loss on its
        last stage): techniques cannot wrap the loss, nor transform the model after the wrap."""
        return False

    def forward_backward(self, task, batch, weight: float, scaler) -> torch.Tensor:
        raise NotImplementedError(f"strategy={self.name} does not own forward and backward")

    def before_optimizer_step(self) -> None:
        """Gradients complete, before clipping (e.g. tied weights held by two stages)."""

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def sequence_shards(self, task, batch) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward and backward: the batch as this process trains on
        it (context parallelism: its part of each sequence, strategies/context_parallel.py)."""
        return contextlib.nullcontext(batch)

    def logged_samples(self, samples: int) -> int:
        """Samples whose loss this rank holds (the pipeline's loss is on its last stages)."""
        return samples

    def parameter_count(self, module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    def describe_width(self, world: int) -> str:
        """`world` processes as data-parallel ranks, e.g. "1 data-parallel rank (2 processes,
        TP=2)": what a resume's refusal names, since only the data-parallel ranks split the
        data."""
        if world == 1:
            return "1 data-parallel rank (1 process)"
        lay = self.layout(world)
        ranks = f"{lay.data_world} data-parallel rank{'s' if lay.data_world != 1 else ''}"
        split = [f"{name.upper()}={n}" for name, n in (("tp", lay.tp), ("pp", lay.pp)) if n > 1]
        if not split:
            return ranks
        return f"{ranks} ({world} processes, {', '.join(split)})"

    def describe_processes(self, world: int) -> str:
        """Appended to the batch line of the run's announcement."""
        return ""


def refuse_unknown(name: str, known: list[str]) -> UserError:
    return UserError(
        f"strategy={name} is not a strategy accel-train knows (it has: {', '.join(known)}). "
        "Pick one of those, or register yours with `@register_strategy(name, Config)` "
        "(accel_train.plugins; docs/architecture.md)."
    )
