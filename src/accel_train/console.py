"""What the user sees on the console while training: the progress bar (rich) or plain lines."""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("accel_train")


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
