"""Metrics sinks: metrics.jsonl always, plus the loggers chosen with
`logger=` (one or several: `logger=[csv,tensorboard,mlflow]`): CSV and TensorBoard files in the
run dir, and the experiment trackers MLflow and Weights & Biases (loggers/mlflow_logger.py,
loggers/wandb_logger.py), optional extras imported only when chosen."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from accel_train.errors import UserError
from accel_train.loggers.mlflow_logger import MlflowTracker
from accel_train.loggers.wandb_logger import WandbTracker

log = logging.getLogger("accel_train")


def json_safe(value: Any) -> Any:
    """A copy of `value` for strict JSON: non-finite floats (NaN, inf) become None, so
    ``json.dumps(..., allow_nan=False)`` never writes a bare NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _write_error(run_dir: Path, err: OSError) -> UserError:
    try:
        usage = shutil.disk_usage(run_dir)
        space = f"{usage.free / 2**20:,.0f} MiB free of {usage.total / 2**20:,.0f} MiB"
    except OSError:
        space = "free space unknown"
    return UserError(
        f"writing the metrics in {run_dir} failed: {err.strerror or err} ({space}). The "
        "checkpoints already written are intact; free some space (or make the run dir "
        f"writable), then continue with `resume=auto hydra.run.dir={run_dir}`."
    )


# Trackers: services with runs of their own, fed the same rows (see Tracker in mlflow_logger).
TRACKERS = {"mlflow": MlflowTracker, "wandb": WandbTracker}


class MetricsLogger:
    """Appends one JSON object per call to metrics.jsonl, mirrored to the chosen loggers.

    Appending means a resumed run keeps the history of the run it continues. Two rules keep that
    history true:
    - the files are opened at the first write, so a run that stops before logging anything (a
      refused resume) leaves them as they were;
    - `rewind()`, called by a resume before anything is logged, drops the rows written after
      the checkpoint it resumes from (the resumed run logs those steps again), so no (step,
      metric) appears twice. `position()` is what a checkpoint records to make that exact.
    """

    def __init__(
        self,
        run_dir: Path,
        loggers: Mapping[str, Any] | str,
        enabled: bool = True,
        run_config: Mapping[str, Any] | None = None,
        tables: tuple[str, ...] = (),
    ):
        """`loggers`: the run's `logger` config (each chosen logger's name -> its settings), or
        one logger's name. `run_config`: the resolved run config, which trackers record.
        `tables`: the tables also kept in `<name>.jsonl` in the run dir, whatever the loggers
        (a task's: Task.table_names)."""
        if isinstance(loggers, str):
            loggers = {} if loggers == "none" else {loggers: {}}
        self.run_dir, self.enabled = Path(run_dir), enabled
        self.loggers = dict(loggers or {})
        if isinstance(run_config, DictConfig):
            run_config = OmegaConf.to_container(run_config, resolve=True)
        self.run_config = run_config
        self.trackers: list[Any] = []
        self.jsonl = self.csv_file = self.csv_writer = self.tb = None
        self.rows = {"jsonl": 0, "csv": 0}  # lines in each file (csv: with its header)
        self.purge_step: int | None = None  # TensorBoard hides its events from this step on
        self._opened = False
        self.tables = tuple(tables)
        self.named: set[str] = set()  # tables whose file the console has named

    def _open(self) -> None:
        self._opened = True
        path = self.run_dir / "metrics.jsonl"
        self.rows["jsonl"] = len(_jsonl_lines(path))
        self.jsonl = open(path, "a", buffering=1)  # noqa: SIM115
        if "csv" in self.loggers:
            path = self.run_dir / "metrics.csv"
            self.rows["csv"] = len(_csv_rows(path))
            self.csv_file = open(path, "a", newline="")  # noqa: SIM115
            self.csv_writer = csv.writer(self.csv_file)
            if not self.rows["csv"]:
                self.csv_writer.writerow(["step", "epoch", "metric", "value"])
                self.rows["csv"] = 1
        if "tensorboard" in self.loggers:
            # Imported here: tensorboard costs about a second of start-up to runs without it.
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(
                log_dir=str(self.run_dir / "tensorboard"), purge_step=self.purge_step
            )
        for name, tracker in TRACKERS.items():
            if name in self.loggers:
                self.trackers.append(
                    tracker(self.loggers[name], self.run_dir, self.run_config or {})
                )

    def log(self, metrics: dict[str, Any], step: int, epoch: int) -> None:
        if not self.enabled:
            return
        try:
            self._write(metrics, step, epoch)
        except OSError as err:  # a full disk or a run dir that went read-only
            raise _write_error(self.run_dir, err) from None

    def _write(self, metrics: dict[str, Any], step: int, epoch: int) -> None:
        if not self._opened:
            self._open()
        row = json_safe({"step": step, "epoch": epoch, **metrics})  # strict JSON: no bare NaN
        self.jsonl.write(json.dumps(row, allow_nan=False) + "\n")
        self.rows["jsonl"] += 1
        # Event rows ({"event": ...}: a resume, a stop, a checkpoint save with its timings) go to
        # metrics.jsonl only: two saves at one step would be one metric logged twice elsewhere.
        numbers = {
            k: v
            for k, v in metrics.items()
            if isinstance(v, int | float) and "event" not in metrics
        }
        if self.csv_writer:
            self.csv_writer.writerows([step, epoch, k, v] for k, v in numbers.items())
            self.csv_file.flush()
            self.rows["csv"] += len(numbers)
        if self.tb:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, global_step=step)
        for tracker in self.trackers:
            tracker.log(numbers, step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A table of text (generation samples: step, prompt, completion) to every chosen
        logger that takes text: TensorBoard (add_text, as a Markdown table), MLflow (a table
        artifact `<name>.json`, appended to), W&B (a wandb.Table). metrics.jsonl and CSV hold
        numbers only: the caller keeps its own file of the rows (samples.jsonl)."""
        if not self.enabled or not rows:
            return
        if not self._opened:
            self._open()
        if name in self.tables:
            self._keep(name, columns, rows, step)
        if self.tb:
            self.tb.add_text(name, markdown_table(columns, rows), global_step=step)
            self.tb.flush()
        for tracker in self.trackers:
            tracker.log_table(name, columns, rows, step)

    def _keep(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """The rows appended to `<name>.jsonl` (one object a row), and the first one on the
        console, naming the file the first time."""
        path = self.run_dir / f"{name}.jsonl"
        try:
            with path.open("a") as f:
                for row in rows:
                    record = json_safe(dict(zip(columns, row, strict=True)))
                    f.write(json.dumps(record, allow_nan=False) + "\n")
        except OSError as err:
            raise _write_error(self.run_dir, err) from None
        where = "" if name in self.named else f" (every row, every logging step: {path})"
        self.named.add(name)
        first = "  ".join(  # (numbers to 4 decimals: the file keeps them whole)
            f"{c}={round(v, 4) if isinstance(v, float) else v!r}"
            for c, v in zip(columns, rows[0], strict=True)
            if c != "step"
        )
        log.info("step %d %s%s: %s", step, name, where, first)

    def position(self) -> dict[str, int] | None:
        """The rows written so far, per file (None on ranks that log nothing)."""
        if not self.enabled:
            return None
        if not self._opened:
            self._open()
        return dict(self.rows)

    def rewind(self, step: int, rows: dict[str, int] | None) -> None:
        """Drop what was logged after a checkpoint at `step` that recorded `rows` (its
        position(); None for checkpoints that predate it): a row stays if it came before the
        checkpoint's position and its step is not past `step`. Event rows ({"event": ...}:
        preempted, resume) always stay: they are history, not metrics. Each file is rewritten
        atomically (temp file, rename); TensorBoard's events from `step + 1` on are hidden
        with its purge_step. Call before the first log()."""
        if not self.enabled:
            return
        if self._opened:
            raise RuntimeError("MetricsLogger.rewind() after the files were opened")
        rows = rows or {}
        self.purge_step = step + 1
        path = self.run_dir / "metrics.jsonl"
        lines = _jsonl_lines(path)
        limit = rows.get("jsonl", len(lines))
        kept = []
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a kill
                continue
            if "event" in row or (i < limit and row.get("step", 0) <= step):
                kept.append(line)
        if kept != lines:
            _replace(path, "".join(f"{line}\n" for line in kept))
        path = self.run_dir / "metrics.csv"
        table = _csv_rows(path)
        limit = rows.get("csv", len(table))
        kept_rows = [
            r for i, r in enumerate(table) if i == 0 or (i < limit and _csv_step(r) <= step)
        ]
        if kept_rows != table:
            buffer = io.StringIO(newline="")
            csv.writer(buffer).writerows(kept_rows)
            _replace(path, buffer.getvalue())
        for name in self.tables:  # (sampled again from the checkpoint on)
            path = self.run_dir / f"{name}.jsonl"
            lines = _jsonl_lines(path)
            kept = [line for line in lines if _jsonl_step(line) <= step]
            if kept != lines:
                _replace(path, "".join(f"{line}\n" for line in kept))

    def close(self) -> None:
        """Close the files; trackers upload config.yaml and summary.json (written before this
        is called) and end their run: finished with a summary, else stopped (preempted, failed)."""
        for f in (self.jsonl, self.csv_file):
            if f:
                f.close()
        if self.tb:
            self.tb.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """TensorBoard renders a text summary as Markdown: a table, its cells' newlines and pipes
    escaped (a completion of code keeps its lines as <br>)."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _jsonl_step(line: str) -> float:
    """A jsonl row's step; a line torn by a kill: past every step (dropped)."""
    try:
        return float(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return math.inf


def _jsonl_lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _csv_rows(path: Path) -> list[list[str]]:
    try:
        with open(path, newline="") as f:
            return [row for row in csv.reader(f) if row]
    except FileNotFoundError:
        return []


def _csv_step(row: list[str]) -> float:
    try:
        return int(row[0])
    except (ValueError, IndexError):  # a row torn by a kill: drop it
        return math.inf


def _replace(path: Path, text: str) -> None:
    """Write beside `path` and rename over it: a kill leaves the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
