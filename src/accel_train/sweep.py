"""Hydra multirun support: the per-job task body, the end-of-sweep summary, plugin checks.

Hydra's own machinery does the sweeping (BasicSweeper grids, the Optuna sweeper, the submitit
launcher); this module only plugs into it:

- `run_job(cfg)` is the task body in multirun mode. It records the job's outcome in
  `<job dir>/status.json`, never lets a failure escape (Hydra's BasicSweeper would re-raise the
  first failed job's exception after the batch, and Optuna would stop), returns the configured
  `objective` from the job's `summary.json`, and with `resume=auto` skips a job whose dir
  already holds a finished run of the same config. A failed job returns None, not NaN: the
  Optuna sweeper (1.3 with optuna 2.10) then records a failed trial and goes on, whereas a NaN
  makes `study.tell` raise and ends the whole search.
- `SweepSummary` is a Hydra Callback (registered in `configs/hydra/default.yaml`). At the end of
  the sweep it reads every job's `status.json` and `summary.json` from the sweep dir (so it also
  works when the jobs ran elsewhere, e.g. on SLURM through submitit), prints a table and writes
  `sweep_summary.csv` and `sweep_summary.json`.
- `check_plugins(argv)` turns "Could not load 'hydra/sweeper/optuna'" into an error naming the
  extra to install, before Hydra starts.

Nothing here imports torch at module level: Hydra instantiates the callback in every run.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import math
import os
import re
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from accel_train.config import CONFIG_DIR, OBJECTIVES, UserError, flatten

log = logging.getLogger("accel_train")

STATUS_FILE = "status.json"
SUMMARY_FILE = "summary.json"
SWEEP_ID_FILE = ".sweep_id"  # in the sweep dir: which invocation the job dirs belong to
SUMMARY_NAME = "sweep_summary"

# Keys that may differ between the run in a job dir and the rerun that skips or resumes it:
# where and how it runs, not what it trains (paths.*: the sweep dir may have moved since;
# launcher.*: set from SLURM's variables inside an allocation).
IGNORED_WHEN_SKIPPING = ("resume", "objective", "trainer.progress", "paths.", "launcher.")

METRICS = ("best_val_acc", "final_val_acc", "train_samples_per_s", "wall_s")


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


# ---- the job ----------------------------------------------------------------------------


def run_job(cfg: DictConfig) -> float | None:
    """One multirun job: train (or skip), record the outcome, return the objective (None when
    the job failed or has no value for it)."""
    from accel_train.launch import launch

    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir)
    if not _main_task():
        # One of several SLURM tasks running this job (submitit with nodes or tasks_per_node
        # above 1: launch() turns them into one distributed run); task 0 keeps the record.
        launch(cfg)
        return _objective(_read_json(job_dir / SUMMARY_FILE) or {}, cfg.objective)
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
        summary = _read_json(job_dir / SUMMARY_FILE)
        if summary is None or _mtime(job_dir / SUMMARY_FILE) == before:  # none, or an old one
            if cfg.launcher.name == "slurm":  # submitted: it trains later, elsewhere
                _write_status(job_dir, status, "submitted")
                return None
            raise UserError(f"the run finished without writing {job_dir / SUMMARY_FILE}.")
        value = _objective(summary, cfg.objective)
        _write_status(job_dir, status, "done", value=value)
        return value
    except Exception as err:  # one failed job must not stop the sweep
        if isinstance(err, UserError):
            error = _one_line(str(err))
            log.error("job %s failed: %s", hc.job.num, error)
        else:
            error = _one_line(f"{type(err).__name__}: {err}")
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
    from accel_train.config import to_container, validate
    from accel_train.launch import resolve

    validate(cfg)  # an invalid job fails even if its dir holds an old result
    if cfg.resume != "auto":
        return None
    stored_cfg = job_dir / "config.yaml"
    summary = _read_json(job_dir / SUMMARY_FILE)
    if not stored_cfg.is_file() or (summary is None and not (job_dir / "checkpoints").is_dir()):
        return None  # nothing there to skip or resume from
    previous = flatten(OmegaConf.to_container(OmegaConf.load(stored_cfg)))
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


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_sweep_id(sweep_dir: Path) -> str | None:
    try:
        return (sweep_dir / SWEEP_ID_FILE).read_text().strip() or None
    except OSError:
        return None


# ---- the summary ------------------------------------------------------------------------


@dataclass
class SweepResult:
    sweep_dir: Path
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] not in ("done", "skipped (done)", "submitted")]


# Set in the sweeping process: the sweep in progress (so that the entrypoint can still write its
# summary if the sweeper raised) and the result of the last one (for the exit status).
_pending: tuple[SweepSummary, DictConfig] | None = None
last_result: SweepResult | None = None


class SweepSummary(Callback):
    """Hydra Callback: a table plus sweep_summary.csv/.json in the sweep dir at the end."""

    def __init__(self, print_table: bool = True) -> None:
        self.print_table = print_table
        self.sweep_id: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _pending, last_result
        sweep_dir = Path(str(config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        self.sweep_id = uuid.uuid4().hex
        (sweep_dir / SWEEP_ID_FILE).write_text(self.sweep_id + "\n")
        _pending, last_result = (self, config), None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _pending, last_result
        _pending = None
        last_result = summarize(config, self.sweep_id, print_table=self.print_table)


def finish_pending() -> None:
    """Write the summary of a sweep whose sweeper raised before Hydra's on_multirun_end."""
    if _pending is not None:
        callback, config = _pending
        try:
            callback.on_multirun_end(config)
        except Exception as err:  # already failing: do not mask the sweeper's error
            log.warning("could not write the sweep summary: %s", err)


def summarize(config: DictConfig, sweep_id: str | None, print_table: bool = True) -> SweepResult:
    sweep_dir = Path(str(config.hydra.sweep.dir))
    objective = str(config.get("objective", "best_val_acc"))
    result = SweepResult(sweep_dir)
    for path in sorted(sweep_dir.rglob(STATUS_FILE)):
        status = _read_json(path)
        if status is None or (sweep_id is not None and status.get("sweep_id") != sweep_id):
            continue  # not a job of this invocation
        result.rows.append(_row(path.parent, status))
    result.rows.sort(key=lambda r: r["job"])
    # What tells the jobs apart: the overrides that not every job shares.
    common = set.intersection(*(set(r["overrides"]) for r in result.rows)) if result.rows else set()
    for row in result.rows:
        varying = [o for o in row["overrides"] if o not in common]
        row["varying"] = varying if len(result.rows) > 1 else row["overrides"]
    direction = OBJECTIVES.get(objective, "maximize")
    scored = [r for r in result.rows if r["objective"] is not None]
    best = None
    if scored:
        pick = max if direction == "maximize" else min
        best = pick(scored, key=lambda r: r["objective"])
    data = {
        "sweep_dir": str(sweep_dir),
        "objective": objective,
        "direction": direction,
        "jobs": len(result.rows),
        "failed": len(result.failed),
        "best": {k: best[k] for k in ("job", "varying", "objective", "dir")} if best else None,
        "rows": result.rows,
    }
    (sweep_dir / f"{SUMMARY_NAME}.json").write_text(json.dumps(data, indent=2) + "\n")
    with open(sweep_dir / f"{SUMMARY_NAME}.csv", "w", newline="") as f:
        columns = ["job", "varying", "status", "error", "objective", *METRICS, "dir", "overrides"]
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in result.rows:
            writer.writerow(
                {
                    **row,
                    "varying": " ".join(row["varying"]),
                    "overrides": " ".join(row["overrides"]),
                }
            )
    if print_table:
        _print(result, objective, direction, best)
    return result


def _row(job_dir: Path, status: dict[str, Any]) -> dict[str, Any]:
    state = status.get("status", "unknown")
    summary = _read_json(job_dir / SUMMARY_FILE) if state in ("done", "skipped") else None
    error = status.get("error")
    if state == "running":
        state, error = "failed", "did not finish (killed, or still running elsewhere)"
    return {
        "job": status.get("job", -1),
        "overrides": list(status.get("overrides", [])),  # all of them: they rerun the job
        "status": "skipped (done)" if state == "skipped" else state,
        "error": error,
        "objective": status.get("value"),
        **{k: (summary or {}).get(k) for k in METRICS},
        "dir": str(job_dir),
    }


def _print(result: SweepResult, objective: str, direction: str, best: dict | None) -> None:
    from rich.console import Console
    from rich.table import Table

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    table = Table(title=f"sweep {result.sweep_dir}", title_justify="left")
    for name, justify in (
        ("job", "right"),
        ("overrides", "left"),
        ("status", "left"),
        ("best acc", "right"),
        ("final acc", "right"),
        ("samples/s", "right"),
        ("wall s", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in result.rows:
        status = row["status"]
        if status == "failed":
            status = f"[red]failed[/red]: {row['error']}"
        elif status == "done":
            status = "[green]done[/green]"
        marker = " *" if best is not None and row["job"] == best["job"] else ""
        table.add_row(
            f"{row['job']}{marker}",
            " ".join(row["varying"]) or "-",
            status,
            num(row["best_val_acc"], ".4f"),
            num(row["final_val_acc"], ".4f"),
            num(row["train_samples_per_s"], ",.0f"),
            num(row["wall_s"], ".1f"),
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    if best is not None:
        console.print(
            f"best ({direction} {objective}): job {best['job']} {' '.join(best['varying'])} "
            f"= {best['objective']:.4f}"
        )
    failed = len(result.failed)
    console.print(
        f"{len(result.rows) - failed} of {len(result.rows)} jobs ok"
        + (f", [red]{failed} failed[/red]" if failed else "")
        + f"; summary in {result.sweep_dir / SUMMARY_NAME}.csv and .json"
    )


# ---- optional plugins -------------------------------------------------------------------

# plugin name in a hydra/sweeper or hydra/launcher choice: (module, extra, pip package, else)
PLUGINS = {
    "optuna": (
        "hydra_plugins.hydra_optuna_sweeper",
        "sweep",
        "hydra-optuna-sweeper",
        "or sweep a plain grid with `-m key=a,b`",
    ),
    "submitit": (
        "hydra_plugins.hydra_submitit_launcher",
        "slurm",
        "hydra-submitit-launcher",
        "or leave out the hydra/launcher override to run the jobs one after another here",
    ),
}
_HYDRA_OVERRIDE = re.compile(r"hydra/(?:sweeper|launcher)\s*:\s*([\w.-]+)")


def check_plugins(argv: list[str]) -> None:
    """Raise a UserError naming the extra to install when an override needs a missing plugin:
    `hydra/sweeper=optuna`, `hydra/launcher=submitit_*`, or a config group option (such as
    `hparams_search=mnist_optuna`) whose defaults override the sweeper or launcher."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, _, values = arg.lstrip("+~").partition("=")
        for value in values.split(","):
            if key in ("hydra/sweeper", "hydra/launcher"):
                uses, via = [value], f"{key}={value}"
            else:
                uses, via = _hydra_choices_in(key, value), arg
            for choice in uses:
                for plugin, (module, extra, package, instead) in PLUGINS.items():
                    if plugin in choice and not _installed(module):
                        raise UserError(
                            f"{via} needs Hydra's {package} plugin (for `{choice}`), which is "
                            f'not installed. Install it with `pip install -e ".[{extra}]"` in '
                            f"the accel-train checkout, {instead}."
                        )


def _hydra_choices_in(group: str, option: str) -> list[str]:
    path = CONFIG_DIR / group / f"{option}.yaml"
    if not re.fullmatch(r"[\w/.-]+", group) or not path.is_file():
        return []
    return _HYDRA_OVERRIDE.findall(path.read_text())


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
