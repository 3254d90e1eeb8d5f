"""Hydra multirun support that needs no torch: the end-of-sweep summary and the plugin check.

- `SweepSummary` is a Hydra Callback (registered in `configs/hydra/default.yaml`). At the end of
  the sweep it reads every job's `status.json` and `summary.json` from the sweep dir (so it also
  works when the jobs ran elsewhere, e.g. on SLURM through submitit), prints a table and writes
  `sweep_summary.csv` and `sweep_summary.json`.
- `check_plugins(argv)` turns "Could not load 'hydra/sweeper/optuna'" into an error naming the
  extra to install, before Hydra starts.

The job side (training each job, status.json) is in `commands/sweep.py`.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from accel_train.config import CONFIG_DIR
from accel_train.config.facts import OBJECTIVES
from accel_train.config.hydra_errors import as_user_error, check_dir_resolves
from accel_train.errors import UserError

log = logging.getLogger("accel_train")

STATUS_FILE = "status.json"
SUMMARY_FILE = "summary.json"
SWEEP_ID_FILE = ".sweep_id"  # in the sweep dir: which invocation the job dirs belong to
SUMMARY_NAME = "sweep_summary"


# Columns of every task besides its monitored metric's (see Columns).
SPEED = ("train_samples_per_s", "wall_s")


@dataclass
class Columns:
    """What the summary shows: the task's monitored metric (task.monitor, e.g. val/acc or
    val/loss, and its mode) as summary.json's best_val_<m>, final_val_<m> and test_<m>, and the
    objective the sweep returns (objective=...)."""

    monitor: str
    mode: str
    objective: str

    @classmethod
    def of(cls, config: DictConfig) -> Columns:
        monitor = str(OmegaConf.select(config, "task.monitor", default=None) or "val/acc")
        mode = str(OmegaConf.select(config, "task.monitor_mode", default=None) or "max")
        objective = str(OmegaConf.select(config, "objective", default=None) or "best_val_acc")
        return cls(monitor, mode, objective)

    @property
    def metrics(self) -> tuple[str, ...]:
        name = self.monitor.rpartition("/")[2]  # val/loss -> loss
        return (f"best_val_{name}", f"final_val_{name}", f"test_{name}", *SPEED)

    @property
    def headers(self) -> tuple[str, ...]:
        name = self.monitor.rpartition("/")[2]
        return (f"best {self.monitor} ({self.mode})", f"final {self.monitor}", f"test/{name}")


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def one_line(text: str) -> str:
    return " ".join(text.split())


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ---- the summary ------------------------------------------------------------------------


@dataclass
class SweepResult:
    sweep_dir: Path
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> list[dict[str, Any]]:
        ok = ("done", "skipped (done)", "submitted", "pruned")  # pruned: an Optuna pruner's stop
        return [r for r in self.rows if r["status"] not in ok]


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
        check_dir_resolves(config, "hydra.sweep.dir")
        sweep_dir = Path(str(config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        self.sweep_id = uuid.uuid4().hex
        (sweep_dir / SWEEP_ID_FILE).write_text(self.sweep_id + "\n")
        _pending, last_result = (self, config), None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _pending, last_result
        _pending = None
        last_result = summarize(config, self.sweep_id, print_table=self.print_table)


def pending() -> bool:
    """A sweep started in this process and its summary is not written yet."""
    return _pending is not None


def failure_paragraph(result: SweepResult, stopped: BaseException | None = None) -> str:
    """One paragraph: how many jobs failed, each failure's reason (jobs with the same reason
    together) and, when the sweeper itself raised afterwards, that it stopped and why."""
    by_reason: dict[str, list[str]] = {}
    for row in result.failed:
        reason = one_line(str(row.get("error") or row["status"]))
        by_reason.setdefault(reason, []).append(str(row["job"]))
    reasons = "; ".join(
        f"job{'s' if len(jobs) > 1 else ''} {', '.join(jobs)}: {reason.rstrip('.')}"
        for reason, jobs in by_reason.items()
    )
    if result.failed:
        text = f"{len(result.failed)} of {len(result.rows)} sweep jobs failed ({reasons})."
    else:
        text = f"the sweep's {len(result.rows)} job(s) so far finished."
    if stopped is not None:
        user = as_user_error(stopped)
        why = str(user) if user is not None else f"{type(stopped).__name__}: {stopped}"
        text += f" Then the sweep stopped: {one_line(why).rstrip('.')}."
    summary = result.sweep_dir / SUMMARY_NAME
    return text + f" Each job's status and reason: {summary}.csv (and .json)."


def finish_pending() -> None:
    """Write the summary of a sweep whose sweeper raised before Hydra's on_multirun_end."""
    if _pending is not None:
        callback, config = _pending
        if not any(Path(str(config.hydra.sweep.dir)).rglob(STATUS_FILE)):
            return  # no job started (e.g. sbatch refused them all): nothing to summarise
        try:
            callback.on_multirun_end(config)
        except Exception as err:  # already failing: do not mask the sweeper's error
            log.warning("could not write the sweep summary: %s", err)


def summarize(config: DictConfig, sweep_id: str | None, print_table: bool = True) -> SweepResult:
    sweep_dir = Path(str(config.hydra.sweep.dir))
    columns = Columns.of(config)
    objective = columns.objective
    result = SweepResult(sweep_dir)
    for path in sorted(sweep_dir.rglob(STATUS_FILE)):
        status = read_json(path)
        if status is None or (sweep_id is not None and status.get("sweep_id") != sweep_id):
            continue  # not a job of this invocation
        result.rows.append(_row(path.parent, status, columns.metrics))
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
        "monitor": columns.monitor,
        "monitor_mode": columns.mode,
        "metrics": list(columns.metrics),
        "jobs": len(result.rows),
        "failed": len(result.failed),
        "best": {k: best[k] for k in ("job", "varying", "objective", "dir")} if best else None,
        "rows": result.rows,
    }
    (sweep_dir / f"{SUMMARY_NAME}.json").write_text(json.dumps(data, indent=2) + "\n")
    with open(sweep_dir / f"{SUMMARY_NAME}.csv", "w", newline="") as f:
        names = ["job", "varying", "status", "error", "objective", *columns.metrics, "dir"]
        writer = csv.DictWriter(f, fieldnames=[*names, "overrides"])
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
        _print(result, columns, direction, best)
    return result


def _row(job_dir: Path, status: dict[str, Any], metrics: tuple[str, ...]) -> dict[str, Any]:
    state = status.get("status", "unknown")
    summary = read_json(job_dir / SUMMARY_FILE) if state in ("done", "skipped", "pruned") else None
    error = status.get("error")
    if state == "running":
        state, error = "failed", "did not finish (killed, or still running elsewhere)"
    return {
        "job": status.get("job", -1),
        "overrides": list(status.get("overrides", [])),  # all of them: they rerun the job
        "status": "skipped (done)" if state == "skipped" else state,
        "error": error,
        "objective": status.get("value"),
        **{k: (summary or {}).get(k) for k in metrics},
        "dir": str(job_dir),
    }


def _print(result: SweepResult, columns: Columns, direction: str, best: dict | None) -> None:
    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    objective = columns.objective
    table = Table(title=f"sweep {result.sweep_dir}", title_justify="left")
    for name in ("job", "overrides", "status"):
        table.add_column(name, justify="right" if name == "job" else "left")
    for name in (*columns.headers, objective, "samples/s", "wall s"):
        table.add_column(name, justify="right")
    best_m, final_m, test_m = columns.metrics[:3]
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
            num(row[best_m], ".4f"),
            num(row[final_m], ".4f"),
            num(row[test_m], ".4f"),
            num(row["objective"], ".4g"),
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

# plugin name in a hydra/sweeper or hydra/launcher choice: (module, extra, what it needs, else)
PLUGINS = {
    "optuna": (
        "optuna",  # hydra_plugins/accel_train_optuna is ours; it needs Optuna itself
        "sweep",
        "Optuna",
        "or sweep a plain grid with `-m key=a,b`",
    ),
    "submitit": (
        "hydra_plugins.hydra_submitit_launcher",
        "slurm",
        "Hydra's hydra-submitit-launcher plugin",
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
                            f"{via} needs {package} (for `{choice}`), which is "
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
