"""The pruning callback: a loop Technique that reports the trial's validation metric after each
epoch and ends the run early when the study's pruner says so.

The sweeper adds it to every trial when `hydra.sweeper.pruner` is set (the override
`+callbacks.optuna_pruning._target_=...`). It finds its trial through the link the sweeper wrote
(<sweep dir>/.optuna_trials/<job number>.json), located by the variables run_job sets
(commands/sweep.py); torchrun workers inherit them. It reaches the study:

- in memory, when the trial trains in the sweeping process (Hydra's basic launcher, one
  process per trial): the live study (_registry.LIVE);
- through `hydra.sweeper.storage` otherwise (DDP trials' rank 0, submitit jobs): a database all
  of them reach. With the study only in memory there, the trial trains to the end, unpruned,
  and says so in its log.

A pruned run ends like an early-stopped one (last.pt, the test pass, summary.json with
`trial_pruned_at_epoch`); run_job then records the job as "pruned" in status.json, and the
sweeper tells Optuna the trial was pruned.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from accel_train.commands.sweep import JOB_NUM_ENV, SWEEP_DIR_ENV
from accel_train.techniques import Technique
from hydra_plugins.accel_train_optuna._registry import LINK_DIR, LIVE

log = logging.getLogger("accel_train")


class ReportToTrial(Technique):
    name = "optuna_pruning"

    def __init__(self) -> None:
        self.link = _read_link()  # None outside an Optuna sweep with a pruner: does nothing
        self.trial: Any = None
        self.pruned_at: int | None = None

    def on_fit_start(self, loop: Any) -> None:
        if self.link is not None and loop.env.is_main:
            self.trial = _open_trial(self.link)

    def on_validation_end(self, loop: Any, metrics: dict[str, float]) -> None:
        # Once an epoch (its end's validation), so that trials of different batch sizes
        # report at the same steps, which is what the pruners compare.
        if self.link is None or loop.batch_in_epoch != 0:
            return
        prune, metric = False, self.link["metric"]
        if self.trial is not None:
            if metric not in metrics:
                log.warning("optuna pruning: validation has no %s to report", metric)
            else:
                self.trial.report(float(metrics[metric]), loop.epoch)
                prune = self.trial.should_prune()
        if loop.env.distributed:  # rank 0 decides; every rank must stop at the same epoch
            vote = torch.tensor([float(prune)], device=loop.env.device)
            prune = loop.env.all_reduce_sum(vote).item() > 0
        if prune and self.pruned_at is None:
            self.pruned_at = loop.epoch
            value = f"{metrics[metric]:.4f}" if metric in metrics else "?"
            loop.finish(
                f"pruned by Optuna's pruner (hydra.sweeper.pruner) after epoch {loop.epoch}: "
                f"{metric}={value}"
            )

    def summary(self, loop: Any) -> dict[str, Any]:
        return {"trial_pruned_at_epoch": self.pruned_at} if self.link is not None else {}


def _read_link() -> dict[str, Any] | None:
    sweep_dir, job = os.environ.get(SWEEP_DIR_ENV), os.environ.get(JOB_NUM_ENV)
    if not sweep_dir or job is None:
        return None
    try:
        return json.loads((Path(sweep_dir) / LINK_DIR / f"{job}.json").read_text())
    except (OSError, ValueError):
        return None


def _open_trial(link: dict[str, Any]) -> Any:
    import optuna
    from hydra.utils import instantiate

    study = LIVE.get(link["study_name"])
    if study is None and link["storage"] is None:
        log.warning(
            "optuna pruning is off for trial %d: its study is in memory in the sweeping "
            "process, and this trial trains in another one (DDP, or a submitit job). Set "
            "hydra.sweeper.storage (e.g. sqlite:///optuna.db on a shared file system) to prune "
            "such trials.",
            link["number"],
        )
        return None
    if study is None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        pruner = instantiate(link["pruner"]) if link.get("pruner") else None
        study = optuna.load_study(
            study_name=link["study_name"],
            storage=link["storage"],
            sampler=optuna.samplers.RandomSampler(),  # never asked to sample here
            pruner=pruner,
        )
    return optuna.trial.Trial(study, link["trial_id"])
