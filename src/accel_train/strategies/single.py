"""strategy=single: one process, one device; the model trained as it is."""

from __future__ import annotations

from accel_train.config.schema import StrategyConfig
from accel_train.errors import UserError
from accel_train.plugins import register_strategy
from accel_train.strategies.base import Strategy


@register_strategy("single", StrategyConfig)
class Single(Strategy):
    name = "single"

    def check_world(self, world: int | None, nproc: int, nnodes: str) -> None:
        if nproc > 1 or nnodes != "1":
            raise UserError(
                f"strategy=single with {self.keys.given}: several processes need a "
                "data-parallel strategy. Drop `strategy=single` (several processes train with "
                "DDP when no strategy is named), name one (`strategy=ddp`, `strategy=fsdp`), "
                f"or set `{self.keys.one}`."
            )
        super().check_world(world, nproc, nnodes)
