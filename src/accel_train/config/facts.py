"""Facts a config implies that code outside the checks reads while a run goes: what validation
logs and which way each metric improves (the loop, checkpointing, early stopping, the sweeper),
how many batches a `trainer.limit_*_batches` leaves (the loaders), and the class a dotted
`_target_` names (read as plain data, never built)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from omegaconf import DictConfig

from accel_train.config.task_facts import BUILTIN_TASKS
from accel_train.errors import UserError

# summary.json keys a sweep may optimise (`objective`), with the direction that is better.
OBJECTIVES: dict[str, str] = {
    "best_val_acc": "maximize",
    "final_val_acc": "maximize",
    "final_val_loss": "minimize",
    "test_acc": "maximize",
    "train_samples_per_s": "maximize",
    "wall_s": "minimize",
    # accel-report's time to trainer.target (or stop_at); null in a run that did not reach it
    "time_to_target_s": "minimize",
}

# A task option's key that another task has and this one refuses, with the paragraph that says
# why: (task option, key) -> the reason and the fix. Read by the unknown-key message (a key set
# on the command line) and by the task's own check (the same key added with `+`).
TASK_KEYS_REFUSED: dict[tuple[str, str], str] = {
    ("preference", "chunked_loss"): (
        "task=preference does not support the chunked loss: task.chunked_loss (a key of "
        "task=language_model) computes one cross-entropy over every token straight from the "
        "last hidden states and the output layer, while preference tuning needs each answer's "
        "own summed log-probs (chosen and rejected rows, and the reference's) to compare them. "
        "Drop `task.chunked_loss`; for long pairs, lower `dataset.max_length` or use "
        "`activation_checkpointing.mode=full`."
    ),
}


def declared_class(target: str):
    """The class (or function) a dotted path names, imported but not built; None when it cannot
    be imported here (the build reports that, naming the key)."""
    module, _, attr = str(target).rpartition(".")
    try:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # as accel_train.targets.locate does
        return getattr(importlib.import_module(module), attr, None)
    except Exception:  # noqa: BLE001 - any import failure: reported by the build, not here
        return None


def declared_task(target: str):
    """The class a task's `_target_` names, as declared_class; for a built-in task, its facts
    (config/task_facts.py: the same plain data, with no torch import)."""
    return BUILTIN_TASKS.get(str(target)) or declared_class(target)


def task_class(cfg: DictConfig):
    """The task option's class, imported (not built), or a built-in task's facts (what the
    checks read of it, config/task_facts.py); None when not importable here."""
    task = cfg.get("task")
    if not isinstance(task, DictConfig) or "_target_" not in task:
        return None
    return declared_task(task._target_)


def validation_metrics(cfg: DictConfig) -> dict[str, str]:
    """What validation logs -> min or max: the task's metrics and the ones user callbacks
    declare (`val_metrics`), read as plain data from their classes (nothing is built)."""
    task = cfg.get("task")
    modes = {"loss": "min"}
    if isinstance(task, DictConfig) and "_target_" in task:
        cls = declared_task(task._target_)
        declare = getattr(cls, "metric_modes", None)
        if callable(declare):
            modes = dict(declare(task))
        else:  # a task class of the user's own without the declaration
            modes.update({str(k): str(v) for k, v in (task.get("metrics") or {}).items()})
    else:
        modes = {"loss": "min", "acc": "max"}
    known = {f"val/{name}": mode for name, mode in modes.items()}
    for node in (cfg.get("callbacks") or {}).values():
        cls = declared_class(node._target_) if "_target_" in node else None
        for name in getattr(cls, "val_metrics", ()) or ():
            known.setdefault(name, "max")
    return known


def limited_batches(limit: int | float, batches: int) -> int:
    """`trainer.limit_*_batches` applied to `batches`: an int is a count (0: all), a float in
    (0, 1] a fraction of them (at least one), as in Lightning."""
    if isinstance(limit, float):
        return max(1, int(limit * batches))
    return min(batches, limit) if limit else batches


def batches_note(loader: Any) -> str:
    """ " (N batches)" after an evaluation's numbers when trainer.limit_*_batches (or
    +debug=fast_dev_run) cut it short of the whole split, else ""."""
    order = getattr(loader, "order", None)
    if not getattr(order, "cut", False):
        return ""
    n = int(order.num_batches)
    return f" ({n} batch{'' if n == 1 else 'es'})"


# Tried in this order, so that ">=" is not read as ">" followed by "=0.9".
_COMPARISONS = (">=", "<=", ">", "<")


def parse_target(text: str, key: str = "trainer.stop_at") -> tuple[str, str, float]:
    """`trainer.stop_at` or `trainer.target`, e.g. 'val/acc>=0.985' -> ('val/acc', '>=', 0.985)."""
    for op in _COMPARISONS:
        metric, found, value = str(text).partition(op)
        if found:
            try:
                return metric.strip(), op, float(value)
            except ValueError:
                break
    raise UserError(
        f"{key}={text!r} is not METRIC OP VALUE: write e.g. "
        f"`{key}='val/acc>=0.985'` or `{key}='val/loss<=0.05'` (quoted)."
    )
