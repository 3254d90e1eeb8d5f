"""Stop training early, at a validation: when the monitored metric stops improving
(`early_stopping.*`, Lightning's EarlyStopping) or once it reaches a target (`trainer.stop_at`,
e.g. `val/acc>=0.985`, recording the time and steps it took).

Both decide on validation metrics, which every rank holds after the same all-reduce, so every
rank takes the same decision without a collective of its own. The loop then finishes normally:
`last.pt` saved, the test pass on `best.pt`, `summary.json` (a `resume=auto` of that run dir
says "already finished"). Their counters are in the checkpoint, so a resumed run keeps its
patience and its time to the target.
"""

from __future__ import annotations

import logging
import operator
import time
from typing import Any

from accel_train.config.facts import parse_target
from accel_train.techniques import Technique

log = logging.getLogger("accel_train")

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


class EarlyStopping(Technique):
    name = "early_stopping"

    def __init__(self, monitor: str, mode: str, patience: int, min_delta: float):
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.bad_validations = 0
        self.stopped_at: int | None = None

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "max":
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def on_validation_end(self, loop: Any, metrics: dict[str, float]) -> None:
        value = metrics[self.monitor]
        if self._improved(value):
            self.best, self.bad_validations = value, 0
            return
        self.bad_validations += 1
        if self.bad_validations >= self.patience:
            self.stopped_at = loop.step
            loop.finish(
                f"early stopping: {self.monitor} has not improved on {self.best:.4g} for "
                f"{self.patience} validation(s)"
            )

    def summary(self, loop: Any) -> dict[str, Any]:
        return {"early_stopped_at_step": self.stopped_at}

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "bad_validations": self.bad_validations,
            "stopped_at": self.stopped_at,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_validations = state["best"], state["bad_validations"]
        self.stopped_at = state["stopped_at"]


class StopAtTarget(Technique):
    """Records the time and steps to a validation target (`trainer.target`), and with
    `stop=True` also ends training there (`trainer.stop_at`)."""

    def __init__(self, target: str, stop: bool = True):
        self.name = "stop_at" if stop else "target"  # the summary key and checkpoint state key
        self.target, self.stop = target, stop
        self.metric, op, self.value = parse_target(target, f"trainer.{self.name}")
        self.reached = _OPS[op]
        self.higher = op.startswith(">")  # which way "best" is, for a target missed
        self.best: float | None = None  # the metric's best value at any validation
        self.trained_s = 0.0  # wall seconds of this target's run before a resume
        self.started = time.perf_counter()
        self.time_to_target_s: float | None = None
        self.steps_to_target: int | None = None

    def on_fit_start(self, loop: Any) -> None:
        self.started = time.perf_counter()

    def on_validation_end(self, loop: Any, metrics: dict[str, float]) -> None:
        value = metrics[self.metric]
        if self.best is None or (value > self.best if self.higher else value < self.best):
            self.best = value
        if self.steps_to_target is not None or not self.reached(value, self.value):
            return
        # From the loop's start (after building), validations included; start-up is in wall_s.
        self.time_to_target_s = self.trained_s + time.perf_counter() - self.started
        self.steps_to_target = loop.step
        reached = (
            f"target {self.target} reached ({self.metric}={metrics[self.metric]:.4f}) at step "
            f"{loop.step}, {self.time_to_target_s:.1f} s"
        )
        if self.stop:
            loop.finish(reached)
        elif loop.env.is_main:
            log.info("%s (trainer.target: training goes on)", reached)

    def summary(self, loop: Any) -> dict[str, Any]:
        """The run's end (called once, as summary.json is written): a target never reached is
        said there and on the console, with the best value the run got to."""
        reached = self.steps_to_target is not None
        best = f"{self.best:.4f}" if self.best is not None else "none: nothing validated"
        missed = f"trainer.{self.name} {self.target} not reached (best {self.metric} {best})"
        if not reached and loop.env.is_main:
            log.warning(missed)
        return {
            self.name: self.target,
            f"{self.name}_reached": reached,
            f"{self.name}_best": self.best,  # the metric's best value over the validations
            "time_to_target_s": self.time_to_target_s,
            "steps_to_target": self.steps_to_target,
        }

    def state_dict(self) -> dict[str, Any]:
        elapsed = self.trained_s + time.perf_counter() - self.started
        return {
            "trained_s": elapsed,
            "time_to_target_s": self.time_to_target_s,
            "steps_to_target": self.steps_to_target,
            "best": self.best,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trained_s = state["trained_s"]
        self.time_to_target_s = state["time_to_target_s"]
        self.steps_to_target = state["steps_to_target"]
        self.best = state.get("best")  # (None in checkpoints before it)
