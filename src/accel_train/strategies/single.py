"""strategy=single: one process, one device; the model trained as it is."""

from __future__ import annotations

from accel_train.errors import UserError
from accel_train.strategies.base import Strategy


class Single(Strategy):
    name = "single"

    def check_world(self, world: int | None, nproc: int, nnodes: str) -> None:
        if nproc > 1 or nnodes != "1":
            raise UserError(
                f"strategy=single with launcher.nproc_per_node={nproc} and launcher.nnodes="
                f"{nnodes}: several processes need a data-parallel strategy. Add `strategy=ddp` "
                "(or `strategy=fsdp`), or set `launcher.nproc_per_node=1`."
            )
        super().check_world(world, nproc, nnodes)
