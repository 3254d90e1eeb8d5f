"""strategy=pipeline: the model cut into consecutive stages, one per process, trained by a
torch.distributed.pipelining schedule (GPipe or 1F1B) over micro-batches of each batch; with
more processes than stages, pipeline replicas under DDP on a (dp, pp) DeviceMesh.

How the model is cut into blocks and stages: pipeline_cut.py.

Every process builds the whole model (same seed: the same weights as one process), keeps its
own blocks and drops the others. What it keeps is the ORIGINAL model object with the other
blocks removed, so its state_dict has the original model's names: the stages' sharded
checkpoints (torch.distributed.checkpoint) together are the whole model, loadable at another
layout or by accel-eval into one process.

The loss lives on the last stage. Each micro-batch's loss is weighted by its share of the batch
(so that micro-batching, a short last batch and accumulation give the one-process gradient)
and summed on the device; the loop reads it at logging steps only. Validation runs a plain
stage-to-stage forward (send/recv of the activations) and broadcasts the logits from the last
stage, so the loop's scoring code runs unchanged on every rank.

torch.distributed.pipelining is imported where a schedule is built, not at the top: the
launcher and the build import this module for its checks on every run, pipeline or not."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from accel_train.errors import UserError
from accel_train.parallel import DistEnv
from accel_train.precision import Precision
from accel_train.strategies.base import WorldKeys
from accel_train.strategies.mesh import MeshLayout
from accel_train.strategies.pipeline_cut import Block, activations, chain, keep_blocks, split

log = logging.getLogger("accel_train")

SCHEDULES = ("gpipe", "1f1b")


# ---- the layout: which process holds which stage of which replica --------------------------


@dataclass(frozen=True)
class Layout:
    stages: int  # pipeline degree (pp)
    replicas: int  # data-parallel degree (dp)
    stage: int  # this process's stage
    replica: int  # this process's data-parallel rank

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1


def stage_layout(mesh: MeshLayout, rank: int) -> Layout:
    """Ranks are laid out (replica, stage), stage fastest: a replica's stages are neighbours
    (the run's mesh, strategies/mesh.py)."""
    return Layout(mesh.pp, mesh.dp_replicate, rank % mesh.pp, mesh.data_rank(rank))


def pipeline_stages(strategy_cfg: DictConfig, world: int, keys: WorldKeys) -> int:
    stages = strategy_cfg.stages or world
    if stages < 2:
        raise UserError(
            f"strategy=pipeline with strategy.stages={strategy_cfg.stages} and {world} "
            f"process(es): a pipeline needs at least 2 stages, one per process. Start 2 or more "
            f"processes ({keys.count}) or use `strategy=single`."
        )
    if world % stages:
        raise UserError(
            f"strategy.stages={stages} does not divide the {world} processes: each pipeline "
            f"replica needs exactly `stages` processes. Set {keys.count} to a multiple of "
            f"{stages}, or `strategy.stages` to a divisor of {world}."
        )
    return stages


# Why packed rows are refused (the config's dataset.pack, or packed shards seen at build time).
PACKED_ROWS = (
    "packed rows pass each record's positions beside the token ids, which keep every record's "
    "attention to itself, and the stages hand each other one tensor, so the records would see "
    "each other; use `dataset.pack=false` (one record a row)"
)


def check_pipeline(cfg: DictConfig, world: int | None, keys: WorldKeys) -> None:
    """What can be refused before any process starts (`world`: None when not known yet)."""
    sc, t = cfg.strategy, cfg.trainer
    if sc.schedule not in SCHEDULES:
        extra = (
            " (interleaved 1F1B needs several stages per process and is not supported yet)"
            if "interleaved" in str(sc.schedule)
            else ""
        )
        raise UserError(
            f"strategy.schedule={sc.schedule!r} is not one of {', '.join(SCHEDULES)}{extra}. "
            "Use `strategy.schedule=1f1b` (less activation memory) or `gpipe`."
        )
    if sc.microbatches < 1:
        raise UserError(
            f"strategy.microbatches={sc.microbatches} must be >= 1 (micro-batches each batch is "
            "cut into), e.g. `strategy.microbatches=4`."
        )
    if cfg.loader.batch_size % sc.microbatches:
        raise UserError(
            f"strategy.microbatches={sc.microbatches} does not divide loader.batch_size="
            f"{cfg.loader.batch_size}: every micro-batch must have the same shape (the stages "
            "exchange fixed-size activations). Pick a batch size that is a multiple of "
            f"{sc.microbatches}, or a divisor of {cfg.loader.batch_size} as microbatches."
        )
    if sc.stages < 0:
        raise UserError(f"strategy.stages={sc.stages} must be >= 0 (0 = one stage per process).")
    if world is not None:
        pipeline_stages(sc, world, keys)
    refused = {
        "precision=fp16": (
            cfg.precision.name == "fp16"
            or (cfg.precision.name == "amp" and t.device != "cpu" and torch.cuda.is_available()),
            "fp16 needs a GradScaler whose overflow check every stage must agree on; use "
            "`precision=bf16` (no scaler)",
        ),
        "dataset.pack=true": (
            OmegaConf.select(cfg, "dataset.pack") is True,
            PACKED_ROWS,
        ),
        "dataset.trim_padding=true": (
            OmegaConf.select(cfg, "dataset.trim_padding") is True,
            "batches cut to their longest row change shape, and the stages exchange "
            "fixed-size activations; set `dataset.trim_padding=false` (rows of one length)",
        ),
        "dataset.document_separator": (
            OmegaConf.select(cfg, "dataset.document_separator") is not None,
            PACKED_ROWS.replace("dataset.pack=false", "dataset.document_separator=null"),
        ),
    }
    for key, (on, why) in refused.items():
        if on:
            raise UserError(
                f"{key} with strategy=pipeline: {why}. Turn it off or train with another strategy."
            )


# ---- the stage module and the training step ---------------------------------------------------


class StageModule(nn.Module):
    """This process's blocks, run in order under autocast. `root` is the pruned original model
    (what the checkpoints hold); the blocks are its modules."""

    def __init__(self, root: nn.Module, blocks: list[Block], precision: Precision):
        super().__init__()
        self.root = root
        self.blocks = tuple(blocks)  # a tuple: not registered twice (root holds the modules)
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            for block in self.blocks:
                x = block(x)
        # Sent to the next stage as is: gloo/NCCL send dense tensors (channels_last is not).
        return x.contiguous()


@dataclass
class Pipeline:
    """The per-process pipeline: its stage, the schedules (one per batch shape) and groups."""

    layout: Layout
    stage_module: StageModule
    train_module: nn.Module  # stage_module, or DDP(stage_module) across replicas
    pp_group: dist.ProcessGroup
    device: torch.device
    schedule: str
    microbatches: int
    precision: Precision
    total_params: int
    # (shape without batch, dtype) of this stage's input and output activations
    io: tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]
    # Parameters held by several stages (a GPT's tied embedding and head): (the stages that hold
    # it, its shape, this stage's Parameter or None).
    shared: list[tuple[tuple[int, ...], torch.Size, nn.Parameter | None]] = field(
        default_factory=list
    )
    _schedules: dict[int, object] = field(default_factory=dict)
    # Set for each step (the schedule's loss function reads them).
    _n: int = 1
    _weight: float = 1.0
    _loss_fn: object = None
    _scaler: object = None
    _total: torch.Tensor | None = None

    def _schedule_for(self, n: int):
        """The schedule for batches of n samples: micro-batches must have one shape, so a short
        last batch gets the largest micro-batch count <= strategy.microbatches dividing it
        (and GPipe when that is fewer than the stages, which 1F1B requires)."""
        if n not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            m = max(d for d in range(1, self.microbatches + 1) if n % d == 0)
            one_f_one_b = self.schedule == "1f1b" and m >= self.layout.stages
            cls = Schedule1F1B if one_f_one_b else ScheduleGPipe
            (in_shape, in_dtype), (out_shape, out_dtype) = self.io
            stage = PipelineStage(
                self.train_module,
                self.layout.stage,
                self.layout.stages,
                self.device,
                input_args=torch.empty(
                    (n // m, *in_shape), dtype=in_dtype, device=self.device
                ).requires_grad_(not self.layout.is_first),  # a gradient goes back to it
                output_args=torch.empty(
                    (n // m, *out_shape), dtype=out_dtype, device=self.device
                ).requires_grad_(),
                group=self.pp_group,
            )
            # scale_grads=False: _microbatch_loss weights each micro-batch by its share.
            self._schedules[n] = cls(stage, m, loss_fn=self._microbatch_loss, scale_grads=False)
        return self._schedules[n]

    def _microbatch_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.precision.autocast():
            loss = self._loss_fn(output, labels)
        k = labels.shape[0]
        self._total.add_(loss.detach(), alpha=k)  # for logging: no host sync
        return self._scaler.scale(loss * (k / self._n * self._weight))

    def step(self, x, labels, weight: float, loss_fn, scaler) -> torch.Tensor:
        """Forward and backward of one loop micro-batch through the pipeline; gradients
        accumulate in .grad as with a plain backward. Returns the batch's mean loss on the last
        stage (zero elsewhere), detached, on the device."""
        n = labels.shape[0]
        self._n, self._weight, self._loss_fn, self._scaler = n, weight, loss_fn, scaler
        self._total = torch.zeros((), device=self.device)
        schedule = self._schedule_for(n)
        args = (x,) if self.layout.is_first else ()
        target = labels if self.layout.is_last else None
        schedule.step(*args, target=target, return_outputs=False)
        return self._total / n

    def sync_shared_grads(self) -> None:
        """A parameter held by several stages (tied weights) has one gradient per stage, each
        the part of the whole model's gradient that flows through that stage: sum them over the
        pipeline group, so every copy takes the same step and the copies stay equal, as
        Megatron-LM keeps its tied embeddings. One all-reduce per shared parameter and step, on
        the device (no host sync)."""
        for _stages, shape, param in self.shared:
            if param is not None and param.grad is not None:
                grad = param.grad
            else:  # a stage without it adds zeros (every rank of the group must take part)
                grad = torch.zeros(shape, device=self.device)
            dist.all_reduce(grad, group=self.pp_group)

    def counted(self, samples: int) -> int:
        """Samples whose loss this rank holds (the logged mean is over the last stages)."""
        return samples if self.layout.is_last else 0

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """Clip by the norm over ALL stages' gradients: the squared local norms all-reduced over
        the pipeline group (replicas hold the same, already averaged, gradients). No host sync."""
        params = [p for p in parameters if p.grad is not None]
        # A shared (tied) parameter counts once: on the first stage that holds it.
        twice = {
            id(p) for held, _, p in self.shared if p is not None and held[0] != self.layout.stage
        }
        counted = [p.grad for p in params if id(p) not in twice]
        if counted:
            local = torch.nn.utils.get_total_norm(counted, 2.0)
            squared = local.float() ** 2
        else:
            squared = torch.zeros((), device=self.device)
        dist.all_reduce(squared, group=self.pp_group)
        total = squared.sqrt()
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def describe(self, stages: list[list[Block]]) -> list[str]:
        lines = []
        for s, blocks in enumerate(stages):
            params = sum(b.params for b in blocks)
            names = [b.name for b in blocks]
            shown = ", ".join(names) if len(names) <= 8 else f"{names[0]} .. {names[-1]}"
            share = params / max(self.total_params, 1)
            lines.append(
                f"  stage {s}: {len(blocks)} blocks ({shown}), {params:,} parameters ({share:.1%})"
            )
        return lines


class PipelineEval(nn.Module):
    """Validation's model: a plain stage-to-stage forward (no schedule), the logits broadcast
    from the last stage so that every rank scores the same batch. Any batch size works: the
    activation's shape and dtype travel ahead of it."""

    def __init__(self, pipe: Pipeline):
        super().__init__()
        self.stage = pipe.stage_module
        self.pipe = pipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, lay = self.pipe, self.pipe.layout
        h = x if lay.is_first else _recv(p.pp_group, lay.stage - 1, p.device)
        h = self.stage(h)
        if not lay.is_last:
            _send(h, p.pp_group, lay.stage + 1)
        # The logits' shape first: it follows the input (a language model's sequence length
        # while sampling), so the other stages cannot know it in advance.
        meta = torch.zeros(_META_LEN, dtype=torch.int64, device=p.device)
        if lay.is_last:
            meta[0] = h.dim()
            meta[1 : 1 + h.dim()] = torch.tensor(h.shape)
        dist.broadcast(meta, group=p.pp_group, group_src=lay.stages - 1)
        if lay.is_last:
            logits = h.float().contiguous()
        else:
            # HOST SYNC (validation): the shape, to allocate the buffer the logits arrive in.
            ndim, *shape = meta.tolist()
            logits = torch.empty(shape[:ndim], device=p.device)
        dist.broadcast(logits, group=p.pp_group, group_src=lay.stages - 1)
        return logits


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_META_LEN = 10


def _send(t: torch.Tensor, group, dst: int) -> None:
    meta = torch.zeros(_META_LEN, dtype=torch.int64, device=t.device)
    meta[0], meta[1] = t.dim(), _DTYPES.index(t.dtype)
    meta[2 : 2 + t.dim()] = torch.tensor(t.shape)
    dist.send(meta, group=group, group_dst=dst)
    dist.send(t.contiguous(), group=group, group_dst=dst)


def _recv(group, src: int, device: torch.device) -> torch.Tensor:
    meta = torch.zeros(_META_LEN, dtype=torch.int64, device=device)
    dist.recv(meta, group=group, group_src=src)
    # HOST SYNC (validation): the activation's shape, to allocate the buffer it arrives in.
    ndim, code, *shape = meta.tolist()
    out = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=device)
    dist.recv(out, group=group, group_src=src)
    return out


# ---- building it -------------------------------------------------------------------------------


def _shared_parameters(stages: list[list[Block]], mine: int):
    """Parameters that blocks of different stages hold (tied weights), in one order on every
    rank: (the stages holding it, its shape, this stage's Parameter or None)."""
    where: dict[int, tuple[nn.Parameter, set[int]]] = {}
    order: list[int] = []
    for s, blocks in enumerate(stages):
        for block in blocks:
            for param in block.module.parameters():
                if id(param) not in where:
                    where[id(param)] = (param, set())
                    order.append(id(param))
                where[id(param)][1].add(s)
    out = []
    for key in order:
        param, held = where[key]
        if len(held) > 1:
            out.append((tuple(sorted(held)), param.shape, param if mine in held else None))
    return out


def build_pipeline(
    module: nn.Module,
    cfg: DictConfig,
    env: DistEnv,
    sample: torch.Tensor,
    precision: Precision,
    mesh: DeviceMesh,
    mesh_layout: MeshLayout,
) -> Pipeline:
    """Cut `module` (in place: it keeps only this process's blocks) and set up the groups on
    the run's `mesh` (its `pp` and `dp_replicate` dimensions).

    Long because the cut's steps hand their results (blocks, starts, stages, activations) one to
    the next, and the refusals between them name what the step before found."""
    if isinstance(sample, Mapping):  # packed shards (dataset=streaming_sft): known only here
        raise UserError(
            f"dataset={cfg.dataset.get('name')} gives packed rows ({', '.join(sample)}) and "
            f"strategy=pipeline cannot train them: {PACKED_ROWS} (shards: write them again with "
            "`accel-data shard dataset=sft dataset.pack=false ...`), or train with another "
            "strategy."
        )
    sc = cfg.strategy
    lay = stage_layout(mesh_layout, env.rank)
    if precision.use_scaler:  # (check_pipeline refuses fp16 up front; a worker checks again)
        raise UserError(
            f"precision={cfg.precision.name} with strategy=pipeline resolves to fp16 with a "
            "GradScaler, whose overflow check every stage would have to agree on. Use "
            "`precision=bf16`."
        )
    target = cfg.model._target_
    blocks = chain(module, sample, target)
    starts = split(blocks, lay.stages, list(sc.split_points), target)
    ends = [*starts[1:], len(blocks)]
    stages = [blocks[a:b] for a, b in zip(starts, ends, strict=True)]
    empty = [s for s, bl in enumerate(stages) if not any(b.params for b in bl)]
    if empty:
        raise UserError(
            f"strategy.split_points={list(sc.split_points)}: stage {empty[0]} would hold no "
            "parameters (only parameter-free blocks). Move the split point so every stage "
            "holds at least one layer with weights."
        )
    total = sum(b.params for b in blocks)
    mine = stages[lay.stage]
    acts = activations(module, blocks, sample, precision)
    io = (acts[starts[lay.stage]], acts[ends[lay.stage]])
    shared = _shared_parameters(stages, lay.stage)
    keep_blocks(module, {b.name for b in mine}, blocks)
    stage_module = StageModule(module, mine, precision)
    train_module: nn.Module = stage_module
    if lay.replicas > 1:
        train_module = DistributedDataParallel(
            stage_module,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            process_group=mesh["dp_replicate"].get_group(),
        )
    pipe = Pipeline(
        layout=lay,
        stage_module=stage_module,
        train_module=train_module,
        pp_group=mesh["pp"].get_group(),
        device=env.device,
        schedule=sc.schedule,
        microbatches=sc.microbatches,
        precision=precision,
        total_params=total,
        io=io,
        shared=shared,
    )
    if env.is_main:
        log.info(
            "pipeline: %d stages x %d replica(s), schedule %s, %d micro-batches of %d; "
            "split %s:\n%s",
            lay.stages,
            lay.replicas,
            sc.schedule,
            sc.microbatches,
            cfg.loader.batch_size // sc.microbatches,
            "at " + ", ".join(sc.split_points) if sc.split_points else "by parameter count",
            "\n".join(pipe.describe(stages)),
        )
    return pipe
