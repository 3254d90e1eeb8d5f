"""strategy=fsdp: FSDP2 (`fully_shard` per block): parameters, gradients and optimizer state
sharded over the mesh's `dp_shard` dimension; with `strategy.tp=N` the layers are first sharded
over `tp` (FSDP x TP, torchtitan's 2-D layout).

FSDP shards the model in units: the modules named by ``strategy.wrap_classes`` (class names),
or the blocks the model declares (``block_names``: model=timm's stages or transformer blocks,
from timm's own grouping), or by default the outermost repeated blocks: every outermost module
that has sub-modules, holds parameters and whose class occurs at least twice (a ResNet's
stages, a transformer's blocks); a model with no such blocks (a flat Sequential) is sharded by
its repeated layers instead. Units that share a parameter (tied weights) stay in the root's
group. Then the root. Each unit is one all-gather in forward and one reduce-scatter in
backward.

With `strategy.cp=N` (context parallelism, context_parallel.py) the sequences are split over
the mesh's `cp` dimension and FSDP shards over dp_shard x cp flattened (torchtitan's
`dp_shard_cp`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from accel_train.config.schema import FsdpConfig
from accel_train.errors import UserError
from accel_train.parallel import DistEnv
from accel_train.plugins import register_strategy
from accel_train.precision import Precision
from accel_train.strategies.base import Strategy, Wrapped
from accel_train.strategies.context_parallel import check_context_parallel, sharded_sequences
from accel_train.strategies.mesh import MeshLayout
from accel_train.strategies.tp import check_tp_divides


@register_strategy("fsdp", FsdpConfig)
class FSDP(Strategy):
    name = "fsdp"
    sharded_checkpoints = True
    shards_parameters = True

    @classmethod
    def runs_whole_model(cls, cfg: Any) -> bool:
        return int(cfg.get("tp", 1) or 1) <= 1  # gathered whole for forward, unless TP splits it

    def tp_degree(self, world: int) -> int:
        return int(self.cfg.get("tp", 1))  # 1 = no tensor parallelism

    def cp_degree(self) -> int:
        return int(self.cfg.get("cp", 1))  # 1 = no context parallelism

    def layout(self, world: int) -> MeshLayout:
        tp, cp = self.tp_degree(world), max(self.cp_degree(), 1)
        check_tp_divides(tp, world, self.keys)
        # dp_shard is kept at degree 1 too: FSDP takes its group when TP takes every process.
        return MeshLayout(dp_shard=world // (tp * cp), cp=cp, tp=tp, keep=("dp_shard",))

    def check_world(self, world: int | None, nproc: int, nnodes: str) -> None:
        if world is not None:
            cp, tp = self.cp_degree(), self.tp_degree(world)
            check_context_parallel(self.run_cfg, cp, tp, world, self.keys)
        super().check_world(world, nproc, nnodes)

    def wrap(self, module: nn.Module, env: DistEnv, sample: Any, precision: Precision) -> Wrapped:
        self.spread = self.tp_degree(env.world_size) if env.distributed else 1
        if not env.distributed:
            return Wrapped(module, module, module)
        # deferred, as tensor_parallel's: torch.distributed.fsdp and DTensor are a second of
        # imports that every command's start-up (which builds this object) would pay
        from torch.distributed.fsdp import fully_shard

        from accel_train.strategies.tensor_parallel import apply_tp

        sc, mesh = self.cfg, self.mesh(env)
        if self.tp_degree(env.world_size) > 1:
            apply_tp(module, mesh["tp"], sc)
        shard_mesh = mesh["dp_shard"]
        self.sequence_split = self.cp_degree()
        if self.sequence_split > 1:  # the ranks of a cp group train the same weights
            self.cp_mesh = mesh["cp"]
            shard_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # noqa: SLF001
        reshard = sc.reshard_after_forward
        for unit in shard_units(module, list(sc.wrap_classes)):
            fully_shard(unit, mesh=shard_mesh, reshard_after_forward=reshard)
        fully_shard(module, mesh=shard_mesh, reshard_after_forward=reshard)
        return Wrapped(module, module, module)

    def sequence_shards(self, task, batch):
        if self.sequence_split == 1:
            return super().sequence_shards(task, batch)
        return sharded_sequences(self.cp_mesh, task, batch)

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        if self.spread > 1:  # gradients on two meshes (FSDP x TP's _StridedShard)
            from accel_train.strategies.tensor_parallel import clip_grad_norm_  # (see wrap)

            return clip_grad_norm_(parameters, max_norm)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)


def shard_units(model: nn.Module, wrap_classes: list[str]) -> list[nn.Module]:
    """The sub-modules FSDP shards one by one (see the module docstring for the policy), less
    those that share a parameter with another unit (tied weights: a one-block GPT's embedding
    and head would otherwise be two units, which FSDP refuses); the root's group holds them."""
    return _untied(_candidate_units(model, wrap_classes))


def _untied(units: list[nn.Module]) -> list[nn.Module]:
    owners: dict[int, set[int]] = {}
    for i, unit in enumerate(units):
        for p in unit.parameters():
            owners.setdefault(id(p), set()).add(i)
    shared = {i for holders in owners.values() if len(holders) > 1 for i in holders}
    return [unit for i, unit in enumerate(units) if i not in shared]


def _candidate_units(model: nn.Module, wrap_classes: list[str]) -> list[nn.Module]:
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
    declared = declared_blocks(model)
    if declared:
        return declared
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


def declared_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks a model names itself (`block_names`, a capability: model=timm's stages or
    transformer blocks from timm's own grouping); [] when it names none, or names a module it
    no longer has (an adapter moved it)."""
    names = getattr(model, "block_names", None) or ()
    try:
        return [model.get_submodule(n) for n in names]
    except AttributeError:
        return []


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
