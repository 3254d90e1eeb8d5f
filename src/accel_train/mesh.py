"""The one DeviceMesh of a run: its named dimensions come from the strategy, and this is the only
place that builds it (strategy wrappers and the pipeline take their process groups from it).

    dp_replicate  data-parallel replicas (DDP; the pipeline's replicas)
    dp_shard      FSDP's sharding dimension
    tp            tensor parallelism (strategy=tp, or strategy.tp under fsdp)
    pp            pipeline stages (strategy=pipeline)

Ranks are laid out with the last dimension fastest: the processes of one tensor-parallel group
(or one pipeline) are neighbours, so on a multi-GPU node they share the fast links. Every
degree is checked against the world size (and a TP degree against the model's heads) before any
process starts (`check_layout`, called by the launcher), then again in the workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from accel_train.errors import UserError


@dataclass(frozen=True)
class MeshLayout:
    """The degrees of the named dimensions (1 = not used), slowest first."""

    dp_replicate: int = 1
    dp_shard: int = 1
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
            for name in ("dp_replicate", "dp_shard", "pp", "tp")
            if getattr(self, name) > 1 or name in self.keep
        )

    @property
    def data_world(self) -> int:
        """How many processes read different data: the data-parallel ones."""
        return self.dp_replicate * self.dp_shard

    def data_rank(self, rank: int) -> int:
        """The data-parallel index of global `rank`: the processes of one TP group or one
        pipeline read the same batches."""
        return rank // (self.pp * self.tp)


def tp_degree(strategy_cfg: DictConfig, world: int) -> int:
    """strategy=tp: `strategy.tp` (0 = every process); fsdp: `strategy.tp` (1 = no TP)."""
    if strategy_cfg.name == "tp":
        return int(strategy_cfg.get("tp", 0)) or world
    if strategy_cfg.name == "fsdp":
        return int(strategy_cfg.get("tp", 1))
    return 1


def layout(strategy_cfg: DictConfig, world: int) -> MeshLayout:
    """The layout of `world` processes under the strategy; a UserError naming the key when a
    degree does not divide the world."""
    name = strategy_cfg.name
    if name == "pipeline":
        stages = pipeline_stages(strategy_cfg, world)
        return MeshLayout(dp_replicate=world // stages, pp=stages, keep=("dp_replicate", "pp"))
    if name not in ("tp", "fsdp"):
        return MeshLayout(dp_replicate=world)
    tp = tp_degree(strategy_cfg, world)
    if tp < 1:
        raise UserError(
            f"strategy.tp={tp} must be >= 1 (the tensor-parallel degree; 1 = no tensor "
            "parallelism), e.g. `strategy.tp=2`."
        )
    if world % tp:
        raise UserError(
            f"strategy.tp={tp} does not divide the {world} processes: each tensor-parallel group "
            f"needs exactly {tp} processes. Set launcher.nproc_per_node (x launcher.nnodes) to a "
            f"multiple of {tp}, or `strategy.tp` to a divisor of {world}."
        )
    if name == "tp" and tp != world:
        raise UserError(
            f"strategy=tp with strategy.tp={tp} and {world} processes: strategy=tp uses every "
            "process for tensor parallelism. To add data parallelism over the other processes "
            f"use `strategy=fsdp strategy.tp={tp}` (FSDP x TP), or set `strategy.tp=0`."
        )
    return MeshLayout(dp_shard=world // tp, tp=tp, keep=("dp_shard",) if name == "fsdp" else ())


def pipeline_stages(strategy_cfg: DictConfig, world: int) -> int:
    stages = strategy_cfg.stages or world
    if stages < 2:
        raise UserError(
            f"strategy=pipeline with strategy.stages={strategy_cfg.stages} and {world} "
            "process(es): a pipeline needs at least 2 stages, one per process. Start 2 or more "
            "processes (`launcher.nproc_per_node=2`) or use `strategy=single`."
        )
    if world % stages:
        raise UserError(
            f"strategy.stages={stages} does not divide the {world} processes: each pipeline "
            "replica needs exactly `stages` processes. Set launcher.nproc_per_node (x nnodes) to "
            f"a multiple of {stages}, or `strategy.stages` to a divisor of {world}."
        )
    return stages


def check_heads(strategy_cfg: DictConfig, heads: int | None, key: str, world: int) -> None:
    """A TP degree must divide the attention heads (each rank computes whole heads)."""
    tp = tp_degree(strategy_cfg, world)
    if tp > 1 and heads is not None and heads % tp:
        raise UserError(
            f"strategy.tp={tp} does not divide {key}={heads}: tensor parallelism gives each "
            f"process whole attention heads. Use a `strategy.tp` that divides {heads}, or a "
            f"model with a multiple of {tp} heads."
        )


def check_layout(cfg: DictConfig, world: int | None) -> None:
    """Before any process starts (`world`: None when not known yet, e.g. nnodes=auto)."""
    if world is None:
        return
    layout(cfg.strategy, world)
    heads = cfg.model.get("n_head") if "model" in cfg else None
    check_heads(cfg.strategy, heads, "model.n_head", world)


def data_coords(strategy_cfg: DictConfig, rank: int, world: int) -> tuple[int, int]:
    """(rank, world) of this process among those that read different data."""
    if world == 1:
        return rank, world
    lay = layout(strategy_cfg, world)
    return lay.data_rank(rank), lay.data_world


def build_mesh(strategy_cfg: DictConfig, device_type: str, world: int) -> DeviceMesh | None:
    """The run's DeviceMesh (None for one process or a strategy with no dimension)."""
    if world == 1:
        return None
    dims = layout(strategy_cfg, world).dims()
    if not dims:
        return None
    names = tuple(name for name, _ in dims)
    return init_device_mesh(device_type, tuple(n for _, n in dims), mesh_dim_names=names)
