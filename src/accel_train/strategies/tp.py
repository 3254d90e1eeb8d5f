"""strategy=tp: tensor parallelism over every process (tensor_parallel.py applies the plan).
The layout check here is shared with FSDP x TP (`strategy=fsdp strategy.tp=N`, fsdp.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from accel_train.config.schema import TpConfig
from accel_train.errors import UserError
from accel_train.parallel import DistEnv
from accel_train.plugins import register_strategy
from accel_train.precision import Precision
from accel_train.strategies.base import Strategy, WorldKeys, Wrapped
from accel_train.strategies.mesh import MeshLayout


def check_tp_divides(tp: int, world: int, keys: WorldKeys) -> None:
    if tp < 1:
        raise UserError(
            f"strategy.tp={tp} must be >= 1 (the tensor-parallel degree; 1 = no tensor "
            "parallelism), e.g. `strategy.tp=2`."
        )
    if world % tp:
        raise UserError(
            f"strategy.tp={tp} does not divide the {world} processes: each tensor-parallel group "
            f"needs exactly {tp} processes. Set {keys.count} to a multiple of {tp}, or "
            f"`strategy.tp` to a divisor of {world}."
        )


@register_strategy("tp", TpConfig)
class TensorParallel(Strategy):
    name = "tp"
    sharded_checkpoints = True

    @classmethod
    def runs_whole_model(cls, cfg: Any) -> bool:
        return False  # each layer split across the processes

    def tp_degree(self, world: int) -> int:
        return int(self.cfg.get("tp", 0)) or world  # 0 = every process

    def layout(self, world: int) -> MeshLayout:
        tp = self.tp_degree(world)
        check_tp_divides(tp, world, self.keys)
        if tp != world:
            raise UserError(
                f"strategy=tp with strategy.tp={tp} and {world} processes: strategy=tp uses every "
                "process for tensor parallelism. To add data parallelism over the other processes "
                f"use `strategy=fsdp strategy.tp={tp}` (FSDP x TP), or set `strategy.tp=0`."
            )
        return MeshLayout(dp_shard=world // tp, tp=tp)

    def wrap(self, module: nn.Module, env: DistEnv, sample: Any, precision: Precision) -> Wrapped:
        self.spread = self.tp_degree(env.world_size) if env.distributed else 1
        if not env.distributed:
            return Wrapped(module, module, module)
        # deferred: DTensor's modules are a second of imports that every command's start-up
        # (which builds this object to check the world size) would pay
        from accel_train.strategies.tensor_parallel import apply_tp

        model = apply_tp(module, self.mesh(env)["tp"], self.cfg)
        return Wrapped(model, model, model)

    def clip_grad_norm_(self, parameters, max_norm: float):
        if self.spread > 1:  # whole and sharded (DTensor) gradients, on several meshes
            from accel_train.strategies.tensor_parallel import clip_grad_norm_  # (see wrap)

            return clip_grad_norm_(parameters, max_norm)
        return super().clip_grad_norm_(parameters, max_norm)
