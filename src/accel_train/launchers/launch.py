"""Compose once, resolve once, write the run config, then run: the body of `accel-train`.

The steps every launch shares live here (validate, resolve, the launcher's refusals, the run
dir's lock, the resume check); how the processes start is the chosen launcher's `launch`
(launchers/<name>.py, chosen by name in launchers/__init__.py). Workers (``python -m
accel_train.worker <config.yaml>``) only ever read the written file; they never compose a config
or parse Hydra overrides.
"""

from __future__ import annotations

import logging
import os

from omegaconf import DictConfig

from accel_train.config.checks import validate
from accel_train.config.run_config import (
    command_line_keys,
    group_chosen,
    resolve,
    set_beyond_option,
)
from accel_train.environment import inside_torchrun
from accel_train.launchers.base import Launcher
from accel_train.launchers.lock import hold_run_dir
from accel_train.launchers.registry import launcher_for
from accel_train.models import prepare_model_config
from accel_train.strategies import default_for_world
from accel_train.train.checkpointing import check as check_checkpointing
from accel_train.train.checkpointing import known_metrics
from accel_train.train.resume import check_resume

log = logging.getLogger("accel_train")


def launch(cfg: DictConfig) -> float | None:
    """The body of `accel-train`: returns the run's objective (summary.json's `objective` key:
    best_val_acc for a classifier, final_val_loss for the other tasks by default)."""
    launcher = launcher_for(cfg)
    # Before validate: its checks see the strategy the run trains with.
    choose_default_strategy(cfg, launcher)
    # Before validate: a timm weights folder may name the architecture (model.name); before
    # resolve: the model's pretrained data config is written into config.yaml with the rest.
    prepare_model_config(cfg)
    train_by_steps(cfg)  # before validate: its checks see the run's real length
    validate(cfg)
    cfg = resolve(cfg)
    launcher.check(cfg)  # before anything is written
    # checkpoint.monitor names a metric validation logs: refused now, not after an epoch.
    check_checkpointing(cfg.checkpoint, known_metrics(cfg))
    hold_run_dir(cfg)  # before anything is written there: one live run per run dir
    # Before anything is written: a refused or unreadable resume leaves the run dir as it was,
    # and a run that already finished is not trained again.
    world = planned_world_size(cfg, launcher)
    finished = check_resume(cfg, world)
    if finished is not None:
        return finished.get(cfg.objective)
    return launcher.launch(cfg)


def planned_world_size(cfg: DictConfig, launcher: Launcher) -> int | None:
    """The number of processes this run will have, where it can be told before starting them
    (None: an elastic node range, or srun's own layout; the loop checks then)."""
    if inside_torchrun():  # started by the user's own torchrun: its world, whatever launcher=
        return int(os.environ["WORLD_SIZE"])
    return launcher.planned_world_size(cfg)


def train_by_steps(cfg: DictConfig) -> None:
    """Lightning's rule: trainer.max_steps given without trainer.max_epochs trains by steps.
    The default max_epochs (3) would otherwise end the run first, without a word. max_epochs
    counts as given on the command line, or in an experiment (or any config that sets another
    value than the trainer option's file); then the run stops at whichever comes first."""
    t = cfg.trainer
    if t.max_steps < 1 or t.max_epochs < 1:
        return
    if "trainer.max_epochs" in command_line_keys():
        return
    if set_beyond_option("trainer", t, ("max_epochs",)):
        return
    t.max_epochs = -1
    log.info(
        "trainer.max_steps=%d and no trainer.max_epochs: training by steps (max_epochs=-1)",
        t.max_steps,
    )


def choose_default_strategy(cfg: DictConfig, launcher: Launcher) -> None:
    """Several processes and no strategy named: DDP, and one line that says so
    (strategies.default_for_world). A strategy the user named is kept, and refused by its own
    check if it cannot run on that many processes."""
    if group_chosen("strategy"):
        return
    said = default_for_world(cfg, planned_world_size(cfg, launcher))
    if said:
        log.info(said)
