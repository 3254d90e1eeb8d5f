"""The one DeviceMesh of a run: its named dimensions come from the strategy, and this is the only
place that builds it (strategy wrappers and the pipeline take their process groups from it).
Each strategy (strategies/*.py) says which layout its processes take (`Strategy.layout`).

    dp_replicate  data-parallel replicas (DDP; the pipeline's replicas)
    dp_shard      FSDP's sharding dimension
    cp            context parallelism (strategy.cp under fsdp): the ranks of one group hold
                  parts of the same sequences; FSDP shards over dp_shard x cp
    tp            tensor parallelism (strategy=tp, or strategy.tp under fsdp)
    pp            pipeline stages (strategy=pipeline)

Ranks are laid out with the last dimension fastest (torchtitan's order): the processes of one
tensor-parallel group (or one pipeline, one context-parallel group) are neighbours, so on a
multi-GPU node they share the fast links. Every degree is checked against the world size (and a
TP degree against the model's heads) before any process starts (`Strategy.check_world`, called
by the launcher), then again in the workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from accel_train.errors import UserError


@dataclass(frozen=True)
class MeshLayout:
    """The degrees of the named dimensions (1 = not used), slowest first."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    pp: int = 1
    tp: int = 1
    # Dimensions kept at degree 1, since the strategy takes their groups (FSDP's dp_shard when
    # TP takes every process; the pipeline's dp_replicate with one replica).
    keep: tuple[str, ...] = ()

    def dims(self) -> tuple[tuple[str, int], ...]:
        """The dimensions the strategy uses (a degree of 1 kept where the strategy needs the
        dimension's group, e.g. FSDP on one process of each TP pair)."""
        return tuple(
            (name, getattr(self, name))
            for name in ("dp_replicate", "dp_shard", "cp", "pp", "tp")
            if getattr(self, name) > 1 or name in self.keep
        )

    @property
    def data_world(self) -> int:
        """How many processes read different data: the data-parallel ones."""
        return self.dp_replicate * self.dp_shard

    def data_rank(self, rank: int) -> int:
        """The data-parallel index of global `rank`: the processes of one TP group, one
        pipeline or one CP group read the same batches."""
        return rank // (self.cp * self.pp * self.tp)


def check_heads(tp: int, heads: int | None, key: str) -> None:
    """A TP degree must divide the attention heads (each rank computes whole heads)."""
    if tp > 1 and heads is not None and heads % tp:
        raise UserError(
            f"strategy.tp={tp} does not divide {key}={heads}: tensor parallelism gives each "
            f"process whole attention heads. Use a `strategy.tp` that divides {heads}, or a "
            f"model with a multiple of {tp} heads."
        )


def build_mesh(layout: MeshLayout, device_type: str, world: int) -> DeviceMesh | None:
    """The run's DeviceMesh (None for one process or a layout with no dimension)."""
    if world == 1:
        return None
    dims = layout.dims()
    if not dims:
        return None
    names = tuple(name for name, _ in dims)
    return init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=names)
