"""Metrics sinks (metrics.jsonl always; CSV or TensorBoard by `logger=`) and progress display."""

from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("accel_train")


class MetricsLogger:
    """Appends one JSON object per call to metrics.jsonl, mirrored to the chosen logger.

    Appending (never truncating) means a resumed run keeps the history of the run it continues.
    """

    def __init__(self, run_dir: Path, kind: str, enabled: bool = True):
        self.enabled = enabled
        self.jsonl = self.csv_file = self.csv_writer = self.tb = None
        if not enabled:
            return
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        if kind == "csv":
            path = run_dir / "metrics.csv"
            new = not path.exists()
            self.csv_file = open(path, "a", newline="")  # noqa: SIM115
            self.csv_writer = csv.writer(self.csv_file)
            if new:
                self.csv_writer.writerow(["step", "epoch", "metric", "value"])
        elif kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, metrics: dict[str, Any], step: int, epoch: int) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, "epoch": epoch, **metrics}) + "\n")
        numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        if self.csv_writer:
            self.csv_writer.writerows([step, epoch, k, v] for k, v in numbers.items())
            self.csv_file.flush()
        if self.tb:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, global_step=step)

    def close(self) -> None:
        for f in (self.jsonl, self.csv_file):
            if f:
                f.close()
        if self.tb:
            self.tb.close()


class Progress:
    """A rich progress bar on a terminal, plain log lines otherwise (or nothing)."""

    def __init__(self, mode: str, enabled: bool):
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode if enabled else "none"
        self.bar = self.task = None
        if self.mode == "rich":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"),
                transient=False,
            )
            self.bar.start()

    def start_epoch(self, epoch: int, total: int, done: int = 0) -> None:
        if self.bar:
            if self.task is not None:
                self.bar.remove_task(self.task)
            self.task = self.bar.add_task(f"epoch {epoch}", total=total, completed=done, stats="")

    def advance(self) -> None:
        if self.bar:
            self.bar.advance(self.task)

    def show(self, metrics: dict[str, Any], step: int, epoch: int) -> None:
        text = "  ".join(_fmt(k, v) for k, v in metrics.items())
        if self.bar:
            self.bar.update(self.task, stats=text)
        elif self.mode == "plain":
            log.info("epoch %d step %d  %s", epoch, step, text)

    def message(self, text: str) -> None:
        if self.bar:
            self.bar.console.print(text)
        elif self.mode == "plain":
            log.info(text)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key}={value:.4g}" if "lr" in key else f"{key}={value:.4f}".rstrip("0")
    return f"{key}={value}"
