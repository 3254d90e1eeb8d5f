"""A task as a third-party package adds one (docs/architecture.md): a classifier under its own
name with a key of its own, registered by its decorator (no YAML; the stored option's
`_target_` is the class). It leaves a file in the working directory when it is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from accel_train.config.schema import ClassificationTaskConfig
from accel_train.plugins import register_task
from accel_train.tasks.classification import Classification


@dataclass
class ToyTaskConfig(ClassificationTaskConfig):
    marker: str = "built_toy_task.txt"  # the file the task writes when it is built


@register_task("toy_cls", ToyTaskConfig)
class ToyTask(Classification):
    def __init__(self, marker: str, top_k: list[int] | tuple[int, ...] = (1,)):
        super().__init__(top_k)
        Path(marker).write_text("built\n")
