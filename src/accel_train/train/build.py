"""Config -> the objects the loop runs: data, model (transformed and wrapped in one ordered
list), loss, optimizer, schedule, precision and techniques. Everything a user can get wrong here
fails before the first step, with the key named."""

from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import TensorDataset

from accel_train.data.build import build_splits
from accel_train.data.images.sample_recipe import apply_sample_recipe, progressive_sizes
from accel_train.data.loaders import build_loader
from accel_train.data.splits import ImageSet, Splits
from accel_train.data.transform import BatchTransform
from accel_train.errors import UserError
from accel_train.models import build_model
from accel_train.optim import build_optimizer, build_scheduler, scaled_lr, schedule_steps
from accel_train.parallel import DistEnv
from accel_train.precision import Precision, resolve_precision
from accel_train.strategies import Strategy, Wrapped, strategy_for
from accel_train.targets import build
from accel_train.tasks import Task, TaskContext, build_task
from accel_train.techniques import PARALLEL, BuildContext, Technique
from accel_train.techniques.activation_checkpointing import ActivationCheckpointing
from accel_train.techniques.channels_last import ChannelsLast
from accel_train.techniques.compile import Compile
from accel_train.techniques.distill import Distill
from accel_train.techniques.early_stopping import EarlyStopping, StopAtTarget
from accel_train.techniques.ema import Ema
from accel_train.techniques.harness import HarnessEval
from accel_train.techniques.lora import Lora, base_is_reloadable
from accel_train.techniques.malloc import TuneMalloc
from accel_train.techniques.nonfinite import NonFinite
from accel_train.techniques.profiler import Profiler
from accel_train.techniques.progressive_resize import ProgressiveResize
from accel_train.techniques.prune import Prune
from accel_train.techniques.qat import QAT
from accel_train.techniques.samples import TrainingSamples
from accel_train.techniques.selective_backprop import SelectiveBackprop
from accel_train.techniques.speed import SpeedMetrics
from accel_train.train.batchnorm_stats import mark_fresh
from accel_train.train.data_checks import check_data_sizes
from accel_train.train.evaluate import sample_batch
from accel_train.train.teacher import teacher_from_checkpoint

log = logging.getLogger("accel_train")


def build_techniques(cfg: DictConfig) -> list[Technique]:
    """The techniques the config switches on, then the user's callbacks (by _target_).

    Long because it is the one ordered list of every technique: their order here is the order
    they wrap the step and run their hooks in."""
    t = cfg.trainer
    chosen: list[Technique] = []
    if cfg.lora.rank > 0:
        chosen.append(Lora(cfg.lora, keep_base=not base_is_reloadable(cfg.model)))
    if t.tune_malloc:
        chosen.append(TuneMalloc())
    ac = cfg.activation_checkpointing
    if ac.mode != "off" or ac.offload:
        chosen.append(ActivationCheckpointing(ac.mode, ac.every, list(ac.classes), ac.offload))
    if t.channels_last:
        chosen.append(ChannelsLast())
    if cfg.quant.name == "qat":
        chosen.append(QAT(cfg.quant))
    if t.compile:
        chosen.append(Compile())
    if t.profile:
        chosen.append(Profiler(t.profile_steps))
    # Selective backprop before distillation: its wrapper is outermost, so the teacher and the
    # student's soft loss see the selected samples.
    sb = cfg.selective_backprop
    if sb.keep < 1:
        chosen.append(SelectiveBackprop(sb.keep, sb.start, sb.end, sb.interrupt))
    if cfg.distill.teacher is not None:
        d = cfg.distill  # a checkpoint teacher is opened by train/teacher.py (the layer above)
        chosen.append(Distill(d.teacher, teacher_from_checkpoint, d.alpha, d.temperature))
    if cfg.prune.amount > 0:
        p, s = cfg.prune, cfg.prune.schedule
        chosen.append(Prune(p.amount, p.method, p.scope, s.start, s.end, s.ramp, s.every_n_steps))
    if t.get("progressive_resize") is not None:
        size = cfg.dataset.get("image_size")
        sizes = progressive_sizes(t.progressive_resize)
        epochs = int(t.max_epochs) if t.max_epochs > 0 else 10**9  # (max_steps: any epoch)
        chosen.append(ProgressiveResize(sizes, size, epochs))
    if cfg.ema.enabled:
        ema = cfg.ema
        chosen.append(Ema(ema.decay, ema.every_n_steps, ema.start_step, ema.warmup))
    # (config/text_checks.py: dataset.tokenizer is set; the run's chat template with it)
    tokenizer = (str(cfg.dataset.get("tokenizer")), cfg.dataset.get("chat_template"))
    if t.sample_every_n_steps > 0:
        chosen.append(
            TrainingSamples(t.sample_every_n_steps, t.sample_prompts, t.sample_max_new_tokens,
                            t.sample_temperature, tokenizer)
        )  # fmt: skip
    if t.harness_every_n_steps > 0:
        chosen.append(HarnessEval(t.harness_every_n_steps, t.harness, tokenizer))
    chosen.append(NonFinite(t.on_nonfinite))  # always on: `stop` costs one add per micro-batch
    chosen.append(SpeedMetrics(t.peak_flops))  # always on: host clocks read at logging steps
    es = cfg.early_stopping
    if es.monitor is not None:
        chosen.append(EarlyStopping(es.monitor, es.mode, es.patience, es.min_delta))
    if t.stop_at is not None:
        chosen.append(StopAtTarget(t.stop_at))
    if t.target is not None and t.target != t.stop_at:  # (an equal stop_at records it)
        chosen.append(StopAtTarget(t.target, stop=False))
    for name, node in cfg.callbacks.items():
        callback = build(node, f"callbacks.{name}", exclude=())
        if not isinstance(callback, Technique):
            raise UserError(
                f"callbacks.{name}._target_={node._target_} built a {type(callback).__name__}; "
                "a callback must subclass accel_train.techniques.Technique."
            )
        callback.name = name
        chosen.append(callback)
    return chosen


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest


def make_loader(
    split, cfg: DictConfig, env: DistEnv, splits: Splits, *, train: bool, limit=0, labelled=True
):
    # (Under pipeline the stages of a replica share data, under TP the processes of a group.)
    rank, world = strategy_for(cfg).data_coords(env)
    return build_loader(
        split,
        cfg.loader,
        train=train,
        device=env.device,
        seed=cfg.trainer.seed,
        rank=rank,
        world=world,
        limit=limit,
        num_classes=splits.num_classes,
        labelled=labelled,
    )


def check_device_loader(
    cfg: DictConfig, splits: Splits, device: torch.device, labelled: bool = True
) -> None:
    """loader=device holds every split as tensors on the device: they must be ImageSets (or,
    for a task without class labels, TensorDatasets) and fit."""
    sets = [s for s in (splits.train, splits.val, splits.test) if s is not None]
    kinds = (ImageSet, TensorDataset) if not labelled else (ImageSet,)
    if not all(isinstance(s, kinds) for s in sets):
        raise UserError(
            f"loader=device needs the whole data set in memory as tensors, which dataset="
            f"{cfg.dataset.name} does not give (the built-in sets do; image_folder does with "
            "dataset.cache=ram or disk and dataset.augment=device; a task without class labels "
            "takes TensorDatasets). Use `loader=torch`."
        )
    if device.type == "cuda":
        nbytes = sum(
            s.nbytes() if isinstance(s, ImageSet) else sum(t.nbytes for t in s.tensors)
            for s in sets
        )
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes > free // 2:
            raise UserError(
                f"loader=device: the data set needs {nbytes / 2**20:.0f} MiB on {device} but "
                f"only {free / 2**20:.0f} MiB are free (half is kept for the model). Use "
                "`loader=torch`."
            )


@dataclass
class Components:
    splits: Splits
    train_loader: Any
    val_loader: Any
    batch_transform: BatchTransform
    module: nn.Module  # the bare model (its state_dict is the checkpoint's)
    model: nn.Module  # what the training step calls (wrapped, compiled)
    eval_model: nn.Module  # what validation calls
    task: Task  # what a step computes and validation scores (accel_train/tasks/)
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    precision: Precision
    techniques: list[Technique]
    steps_per_epoch: int
    total_steps: int
    max_epochs: int
    global_batch: int
    strategy: Strategy  # the run's parallelism (accel_train/strategies/), the model wrapped


def build_components(cfg: DictConfig, env: DistEnv) -> Components:
    t = cfg.trainer
    techniques = build_techniques(cfg)
    for technique in techniques:
        technique.before_build()
    seed_everything(t.seed, t.deterministic)
    precision = resolve_precision(cfg.precision.name, env.device, cfg.precision.tf32)
    strategy = strategy_for(cfg)

    task = build_task(cfg)
    splits, train_loader, val_loader = build_data(cfg, env, task)
    data_world = strategy.data_coords(env)[1]
    global_batch = cfg.loader.batch_size * t.accumulate_grad_batches * data_world
    steps_per_epoch, total_steps = run_length(cfg, train_loader)
    val_samples = check_data_sizes(
        cfg,
        num_train=len(splits.train),
        num_val=len(splits.val),
        world_size=data_world,
        total_steps=total_steps,
        max_epochs=math.ceil(total_steps / steps_per_epoch),
        warn=env.is_main,
        steps_per_epoch=steps_per_epoch,
    )
    transform = BatchTransform(
        cfg.dataset, splits, env.device, precision.param_dtype, seed=t.seed, rank=env.rank
    )
    module, batch = model_for_task(cfg, env, splits, task, transform, precision, val_samples)
    build_ctx = BuildContext(cfg, env, transform, task.inputs(batch), task, batch, strategy)
    wrapped = apply_transforms(module, techniques, build_ctx, strategy, precision)
    optimizer, scheduler = optimizer_and_schedule(
        wrapped.model,
        cfg,
        env,
        global_batch,
        total_steps,
        bare=wrapped.module,
        steps_per_epoch=steps_per_epoch,
    )
    return Components(
        splits=splits,
        train_loader=train_loader,
        val_loader=val_loader,
        batch_transform=transform,
        module=wrapped.module,
        model=wrapped.model,
        eval_model=wrapped.eval_model,
        task=task,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=precision.grad_scaler(),
        precision=precision,
        techniques=techniques,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        max_epochs=math.ceil(total_steps / steps_per_epoch),
        global_batch=global_batch,
        strategy=strategy,
    )


def model_for_task(
    cfg: DictConfig,
    env: DistEnv,
    splits: Splits,
    task: Task,
    transform: BatchTransform,
    precision: Precision,
    val_samples: int,
) -> tuple[nn.Module, Any]:
    """The bare model on the device, with the task set up on it; and two real training samples
    prepared by the task (what the model transforms are checked and traced on)."""
    module = build_model(cfg.model, splits.data_args, precision.param_dtype)
    mark_fresh(module)  # BatchNorm statistics not loaded: judged at evaluation
    module = module.to(env.device, dtype=precision.param_dtype)
    # As the model will see them: a device augment (e.g. image_folder's crop) changes the size.
    augment = splits.device_augment is not None
    ctx = TaskContext(
        cfg,
        env.device,
        splits.data_args,
        transform,
        module,
        sample_batch(splits, env.device),
        augment,
        val_samples,
        warn=env.is_main,
        splits=splits,
    )
    task.setup(ctx)
    return module, ctx.prepared(task)


def build_data(cfg: DictConfig, env: DistEnv, task: Task) -> tuple[Splits, Any, Any]:
    """The splits and the training and validation loaders (this process's shard of them)."""
    t, labelled = cfg.trainer, task.labelled_data
    splits = build_splits(cfg.dataset, cfg.paths.data_dir, labelled, cfg.task)
    apply_sample_recipe(cfg.dataset, cfg.trainer, splits)  # auto_augment, progressive_resize
    if cfg.loader.name == "device":
        check_device_loader(cfg, splits, env.device, labelled)
    train_loader = make_loader(
        splits.train, cfg, env, splits, train=True, limit=t.limit_train_batches, labelled=labelled
    )
    val_loader = make_loader(
        splits.val, cfg, env, splits, train=False, limit=t.limit_val_batches, labelled=labelled
    )
    if len(train_loader) == 0:
        raise UserError(
            f"loader.batch_size={cfg.loader.batch_size} x {env.world_size} process(es) is larger "
            f"than the {len(splits.train)} training samples with loader.drop_last=true: no batch "
            "to train on. Lower loader.batch_size or set `loader.drop_last=false`."
        )
    if env.is_main:
        line = device_batch_line(splits.val, val_loader)
        if line:
            log.info(line)
    return splits, train_loader, val_loader


def device_batch_line(split: Any, loader: Any) -> str | None:
    """Where each evaluation sample is several views (a video's clips x crops), the batch the
    device sees is the loader's batch times them: one line says it (a memory estimate from
    loader.eval_batch_size alone would be off by that factor)."""
    views = int(getattr(split, "views", 1) or 1)
    batch = int(getattr(getattr(loader, "order", None), "batch_size", 0) or 0)
    if views <= 1 or not batch:
        return None
    return (
        f"evaluation: loader.eval_batch_size={batch} counts samples, each {views} views "
        f"({split.views_from}): the device sees {batch * views} a batch (lower "
        "loader.eval_batch_size if validation runs out of memory)"
    )


def run_length(cfg: DictConfig, train_loader: Any) -> tuple[int, int]:
    """(optimizer steps per epoch, optimizer steps of the whole run)."""
    t = cfg.trainer
    steps_per_epoch = math.ceil(train_loader.order.num_batches / t.accumulate_grad_batches)
    total_steps = t.max_epochs * steps_per_epoch
    if t.max_steps > 0:
        total_steps = min(total_steps, t.max_steps) if t.max_epochs > 0 else t.max_steps
    return steps_per_epoch, total_steps


def optimizer_and_schedule(
    model: nn.Module,
    cfg: DictConfig,
    env: DistEnv,
    global_batch: int,
    total_steps: int,
    bare: nn.Module | None = None,
    steps_per_epoch: int = 0,
) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer over the trained parameters (frozen ones, model.freeze or a LoRA base, get
    no state) at the batch-scaled lr, and its per-step schedule. `bare`: the unwrapped model,
    whose layer groups optimizer.layer_decay reads."""
    lr = scaled_lr(cfg.optimizer, global_batch)
    optimizer = build_optimizer(model, cfg.optimizer, lr, env.device, bare=bare)
    scheduler = build_scheduler(
        optimizer,
        cfg.scheduler,
        total_steps,
        lr / cfg.optimizer.lr,
        steps_per_epoch=steps_per_epoch,
    )
    if env.is_main and any(cfg.scheduler.get(k) is not None for k in EPOCH_KEYS):
        log.info(schedule_line(cfg.scheduler, steps_per_epoch, global_batch))
    return optimizer, scheduler


EPOCH_KEYS = ("warmup_epochs", "step_epochs")


def schedule_line(sched_cfg: DictConfig, steps_per_epoch: int, global_batch: int) -> str:
    """The start-up line of a schedule given in epochs: what it is in this run's steps."""
    warmup, step_size = schedule_steps(sched_cfg, steps_per_epoch)
    parts = []
    if sched_cfg.get("warmup_epochs") is not None:
        parts.append(f"warm-up {sched_cfg.warmup_epochs:g} epochs = {warmup} steps")
    if sched_cfg.get("step_epochs") is not None:
        parts.append(
            f"lr x{sched_cfg.gamma:g} every {sched_cfg.step_epochs:g} epochs = {step_size} steps"
        )
    return (
        f"scheduler: {'; '.join(parts)} (this run's epoch: {steps_per_epoch} optimizer steps "
        f"at a global batch of {global_batch})"
    )


def apply_transforms(
    module: nn.Module,
    techniques: list[Technique],
    ctx: BuildContext,
    strategy: Strategy,
    precision: Precision,
) -> Wrapped:
    """The model transforms in their one order, the strategy's wrap at PARALLEL. A strategy
    that runs forward and backward itself (the pipeline schedule, loss on its last stage)
    calls its stage modules directly: no technique may change the loss or come after it."""
    owns_step = strategy.owns_forward_backward(ctx.env)
    bare = module
    ordered = sorted(techniques, key=lambda t: t.order)
    for technique in ordered:
        if owns_step:
            refuse_with_own_step(technique, strategy.name)
        if technique.order < PARALLEL:
            module = technique.transform(module, ctx)
    wrapped = strategy.wrap(module, ctx.env, ctx.sample, precision)
    model, eval_model = wrapped.model, wrapped.eval_model
    for technique in ordered:
        if technique.order > PARALLEL:
            shared = eval_model is model
            model = technique.transform(model, ctx)
            eval_model = model if shared else technique.transform(eval_model, ctx)
    # The checkpoints hold the bare model's state_dict (the transforms before the wrap change it
    # in place), or the part of it a strategy kept (a pipeline stage's blocks).
    kept = bare if wrapped.module is module else wrapped.module
    return Wrapped(model, eval_model, kept)


def refuse_with_own_step(technique: Technique, strategy: str) -> None:
    if technique.wraps_loss:
        raise UserError(
            f"{technique.name} with strategy={strategy}: it changes what a training step "
            "computes (wrap_loss), but under pipeline the loss is computed on the last "
            "stage by the schedule, per micro-batch. Turn it off or use strategy=ddp."
        )
    if technique.order > PARALLEL:
        raise UserError(
            f"{technique.name} with strategy={strategy}: it transforms the model after the "
            "parallel wrap, but the pipeline schedule calls the stage modules itself. "
            "Turn it off or train with another strategy."
        )
