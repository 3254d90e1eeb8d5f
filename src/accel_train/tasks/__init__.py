"""Tasks: what a training step computes and what validation scores, one small file each
(`base.py` says what a task is). Built by `_target_` from the `task` group, like a loss."""

from __future__ import annotations

from omegaconf import DictConfig

from accel_train.errors import UserError
from accel_train.targets import build
from accel_train.tasks.base import Running, Task, TaskContext, split_output
from accel_train.tasks.predictions import Predictions

__all__ = ["Predictions", "Running", "Task", "TaskContext", "build_task", "split_output"]

# Keys of every task option that accel-train reads itself (never passed to the class).
OWN_KEYS = ("name", "monitor", "monitor_mode", "objective")


def build_task(cfg: DictConfig) -> Task:
    # A task's nested `_target_`s (task=grpo's reward functions) are its own to build.
    task = build(cfg.task, "task", exclude=OWN_KEYS, recursive=False)
    if not isinstance(task, Task):
        raise UserError(
            f"task._target_={cfg.task._target_} built a {type(task).__name__}; a task must "
            "subclass accel_train.tasks.Task (or use `task=custom task.step=...` for a step "
            "function)."
        )
    return task
