"""Hydra multirun jobs: the per-job task body.

`run_job(cfg)` records the job's outcome in `<job dir>/status.json`, never lets a failure
escape (Hydra's BasicSweeper would re-raise the first failed job's exception after the batch,
and Optuna would stop), returns the configured `objective` from the job's `summary.json`, and
with `resume=auto` skips a job whose dir already holds a finished run of the same config. A
failed job returns None, not NaN: the Optuna sweeper (1.3 with optuna 2.10) then records a
failed trial and goes on, whereas a NaN makes `study.tell` raise and ends the whole search.
The summary of the whole sweep is `commands/sweep_summary.py`.

A job of `hydra/launcher=submitit_slurm` that submitit requeued (after a preemption or the time
limit, launchers/slurm_job.py) runs this again in the same job dir: it continues from last.pt
(`resume=auto` unless the sweep set `resume`), and status.json says "requeued" in between.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from accel_train.commands.sweep_summary import (
    STATUS_FILE,
    SUMMARY_FILE,
    SWEEP_ID_FILE,
    one_line,
    read_json,
)
from accel_train.config.checks import validate
from accel_train.config.facts import OBJECTIVES
from accel_train.config.hydra_errors import as_user_error
from accel_train.config.run_config import flatten, resolve, to_container
from accel_train.errors import UserError
from accel_train.launchers.launch import launch
from accel_train.launchers.registry import launcher_for
from accel_train.launchers.slurm_job import Requeued, await_submitit_requeue, requeued_submitit_job
from accel_train.train.signals import Stopped, signal_name

log = logging.getLogger("accel_train")

# Set for each job's process: the sweep dir and the job's number (see run_job).
SWEEP_DIR_ENV, JOB_NUM_ENV = "ACCEL_TRAIN_SWEEP_DIR", "ACCEL_TRAIN_SWEEP_JOB_NUM"

# Keys that may differ between the run in a job dir and the rerun that skips or resumes it:
# where and how it runs, not what it trains (paths.*: the sweep dir may have moved since;
# launcher.*: set from SLURM's variables inside an allocation).
IGNORED_WHEN_SKIPPING = ("resume", "objective", "trainer.progress", "paths.", "launcher.")

# ---- the job ----------------------------------------------------------------------------


def run_job(cfg: DictConfig) -> float | None:
    """One multirun job: train (or skip), record the outcome, return the objective (None when
    the job failed or has no value for it).

    Long because every outcome of the job (skipped, submitted, done, pruned, requeued,
    stopped, failed) is recorded by the one try statement that owns its status file."""
    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir)
    # Which sweep job this process (and its torchrun workers) trains: an Optuna trial's pruning
    # callback finds its trial from them (hydra_plugins/accel_train_optuna/_pruning.py).
    os.environ[SWEEP_DIR_ENV] = str(Path(hc.sweep.dir).absolute())
    os.environ[JOB_NUM_ENV] = str(hc.job.num)
    if cfg.resume is None and requeued_submitit_job():
        # submitit requeued this job (preempted, or the time limit): the same job again.
        log.info("job %s requeued by SLURM: resuming from %s (resume=auto)", hc.job.num, job_dir)
        cfg.resume = "auto"
    if not _main_task():
        # One of several SLURM tasks running this job (submitit with nodes or tasks_per_node
        # above 1: launch() turns them into one distributed run); task 0 keeps the record.
        launch(cfg)
        return _objective(read_json(job_dir / SUMMARY_FILE) or {}, cfg.objective)
    status: dict[str, Any] = {
        "job": int(hc.job.num),
        "overrides": list(hc.overrides.task),
        "sweep_id": _read_sweep_id(Path(hc.sweep.dir)),
        "objective": str(cfg.objective),
        "started": time.time(),
    }
    _write_status(job_dir, status, "running")
    try:
        stored = _finished_run(cfg, job_dir)
        if stored is not None:
            log.info("job %s already finished in %s: skipped (resume=auto)", hc.job.num, job_dir)
            value = _objective(stored, cfg.objective)
            _write_status(job_dir, status, "skipped", value=value)
            return value
        before = _mtime(job_dir / SUMMARY_FILE)
        launch(cfg)
        summary = read_json(job_dir / SUMMARY_FILE)
        if summary is None or _mtime(job_dir / SUMMARY_FILE) == before:  # none, or an old one
            if launcher_for(cfg).submits_and_exits(cfg):  # it trains later, elsewhere
                _write_status(job_dir, status, "submitted")
                return None
            raise UserError(f"the run finished without writing {job_dir / SUMMARY_FILE}.")
        value = _objective(summary, cfg.objective)
        # An Optuna trial its pruner stopped early: a result, but not a finished run's.
        pruned = summary.get("trial_pruned_at_epoch") is not None
        _write_status(job_dir, status, "pruned" if pruned else "done", value=value)
        return value
    except Requeued:
        _write_status(job_dir, status, "requeued")  # the requeued run writes the outcome
        raise
    except Stopped as stop:  # SIGTERM/SIGINT: last.pt saved, the process exits with 128 + sig
        error = f"stopped by {signal_name(stop.signum)}; rerun the sweep with resume=auto"
        try:
            if stop.signum == signal.SIGTERM:  # in a submitit job: maybe a preemption
                await_submitit_requeue(job_dir / "checkpoints" / "last.pt")
        except Requeued:
            _write_status(job_dir, status, "requeued")
            raise
        except UserError as err:  # submitit did not requeue it: say why
            error = one_line(str(err))
        _write_status(job_dir, status, "stopped", error=error)
        raise stop
    except Exception as err:  # one failed job must not stop the sweep
        user = as_user_error(err)  # Hydra's and OmegaConf's config errors too
        if user is not None:
            error = one_line(str(user))
            log.error("job %s failed: %s", hc.job.num, error)
        else:
            error = one_line(f"{type(err).__name__}: {err}")
            log.error("job %s failed: %s\n%s", hc.job.num, error, traceback.format_exc())
        _write_status(job_dir, status, "failed", error=error)
        return None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _main_task() -> bool:
    return os.environ.get("SLURM_PROCID", "0") == "0"


def _finished_run(cfg: DictConfig, job_dir: Path) -> dict[str, Any] | None:
    """With resume=auto: the summary of a finished run of this same config in job_dir (None:
    run it, continuing from its last checkpoint if there is one). A run of another config
    there (a different grid into the same sweep dir) is an error, not something to resume."""
    validate(cfg)  # an invalid job fails even if its dir holds an old result
    if cfg.resume != "auto":
        return None
    stored_cfg = job_dir / "config.yaml"
    summary = read_json(job_dir / SUMMARY_FILE)
    if not stored_cfg.is_file() or (summary is None and not (job_dir / "checkpoints").is_dir()):
        return None  # nothing there to skip or resume from
    previous = flatten(OmegaConf.to_container(OmegaConf.load(stored_cfg), resolve=True))
    current = flatten(to_container(resolve(cfg)))
    differs = sorted(
        k
        for k in set(previous) | set(current)
        if not k.startswith(IGNORED_WHEN_SKIPPING) and previous.get(k) != current.get(k)
    )
    if differs:
        key = differs[0]
        raise UserError(
            f"resume=auto: {job_dir} holds a run of a different config ({key}="
            f"{previous.get(key)!r} there, {current.get(key)!r} now). Rerun the sweep with the "
            "same overrides to skip finished jobs, or give a new `hydra.sweep.dir`."
        )
    return summary


def _objective(summary: dict[str, Any], name: str) -> float | None:
    if name not in OBJECTIVES:
        raise UserError(f"objective={name!r} is not one of {', '.join(OBJECTIVES)}.")
    value = summary.get(name)
    return None if value is None or math.isnan(float(value)) else float(value)


def _write_status(job_dir: Path, status: dict[str, Any], state: str, **extra: Any) -> None:
    status.update(status=state, updated=time.time(), **extra)
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / STATUS_FILE
    tmp = path.with_name(f".{STATUS_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(status, indent=2) + "\n")
    os.replace(tmp, path)


def _read_sweep_id(sweep_dir: Path) -> str | None:
    try:
        return (sweep_dir / SWEEP_ID_FILE).read_text().strip() or None
    except OSError:
        return None
