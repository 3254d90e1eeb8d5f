"""The checks of a config against the real data, run by the build once the splits exist: what
the data sizes make pointless is warned about here (the config alone is checked in
accel_train.config.checks, before any process starts)."""

from __future__ import annotations

import math

from omegaconf import DictConfig

from accel_train.config.checks import warn_once
from accel_train.config.facts import limited_batches
from accel_train.optim import schedule_steps


def check_data_sizes(
    cfg: DictConfig,
    *,
    num_train: int,
    num_val: int,
    world_size: int,
    total_steps: int,
    max_epochs: int,
    warn: bool = True,
    steps_per_epoch: int = 0,
) -> int:
    """The checks that need the data sizes (call once the splits are built): refuse what makes
    the run pointless, warn about what is probably not meant. `warn=False` on all but one
    process keeps the warnings to one copy. Returns how many samples one validation scores
    (the task checks that against what it needs: a classifier, one per class)."""
    t, lc = cfg.trainer, cfg.loader
    per_rank = num_train // world_size
    full, rest = divmod(per_rank, lc.batch_size)
    batches = full + (1 if rest and not lc.drop_last else 0)
    eval_bs = lc.eval_batch_size or lc.batch_size
    val_batches = math.ceil(math.ceil(num_val / world_size) / eval_bs)
    warnings = [
        *_batch_warnings(cfg, batches, val_batches, num_train, num_val, world_size),
        *_interval_warnings(cfg, total_steps, max_epochs, steps_per_epoch),
    ]
    if warn:
        for text in warnings:
            warn_once(text)
    return min(num_val, limited_batches(t.limit_val_batches, val_batches) * eval_bs * world_size)


def _batch_warnings(
    cfg: DictConfig, batches: int, val_batches: int, num_train: int, num_val: int, world_size: int
) -> list[str]:
    """Batch limits and an accumulation that the epochs' sizes make moot."""
    t, lc = cfg.trainer, cfg.loader
    warnings = []
    if isinstance(t.limit_train_batches, int) and t.limit_train_batches > batches:
        warnings.append(
            f"trainer.limit_train_batches={t.limit_train_batches} has no effect: an epoch has "
            f"only {batches} batches ({num_train} training samples / loader.batch_size="
            f"{lc.batch_size} x {world_size} process(es))"
        )
    if isinstance(t.limit_val_batches, int) and t.limit_val_batches > val_batches:
        warnings.append(
            f"trainer.limit_val_batches={t.limit_val_batches} has no effect: validation has "
            f"only {val_batches} batches ({num_val} samples)"
        )
    limited = limited_batches(t.limit_train_batches, batches)
    if t.accumulate_grad_batches > limited:
        warnings.append(
            f"trainer.accumulate_grad_batches={t.accumulate_grad_batches} is more than the "
            f"{limited} batches of an epoch: each optimizer step accumulates the whole epoch, "
            "a smaller global batch than the one logged at start-up"
        )
    return warnings


def _interval_warnings(
    cfg: DictConfig, total_steps: int, max_epochs: int, steps_per_epoch: int = 0
) -> list[str]:
    """Validation, logging, checkpoint and lr-decay intervals longer than the run."""
    t, sched = cfg.trainer, cfg.scheduler
    warnings = []
    # warned about already by config.checks.check_pointless:
    warned = 0 < t.max_epochs < t.val_every_n_epochs and t.max_steps < 1
    if t.val_every_n_epochs > max_epochs > 0 and not warned:
        warnings.append(
            f"trainer.val_every_n_epochs={t.val_every_n_epochs} but the run has {max_epochs} "
            "epoch(s): validation runs only once, after the last step"
        )
    if t.log_every_n_steps > total_steps:
        warnings.append(
            f"trainer.log_every_n_steps={t.log_every_n_steps} is more than the run's "
            f"{total_steps} optimizer steps: no train/loss is logged (and a non-finite loss is "
            "caught only at validation and checkpoint saves). Use e.g. `trainer.log_every_n_steps="
            f"{max(1, total_steps // 10)}`"
        )
    if t.ckpt_every_n_steps > total_steps:
        warnings.append(
            f"trainer.ckpt_every_n_steps={t.ckpt_every_n_steps} is more than the run's "
            f"{total_steps} optimizer steps: last.pt is saved at epoch ends only"
        )
    in_epochs = sched.get("step_epochs") is not None or sched.get("warmup_epochs") is not None
    if in_epochs and not steps_per_epoch:
        return warnings  # (converted at build with the steps per epoch: schedule_steps)
    warmup, step_size = schedule_steps(sched, steps_per_epoch)
    if sched.name == "step" and warmup + step_size >= total_steps:
        given = (
            f"scheduler.step_epochs={sched.step_epochs} ({step_size} steps)"
            if sched.get("step_epochs") is not None
            else f"scheduler.step_size={step_size}"
        )
        warnings.append(
            f"{given}: the run's {total_steps} optimizer steps end before the first decay (a "
            "constant lr)"
        )
    return warnings
