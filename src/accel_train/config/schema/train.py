"""The root of accel-train's config: one field per group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class TrainConfig:
    name: str = "train"
    resume: str | None = None
    resume_new_tokenizer: bool = False
    objective: str = "best_val_acc"
    # One style for every group: the field holds whichever option YAML the defaults list (or
    # the command line) picks, and that option names its own schema (OPTION_SCHEMAS) in its
    # `defaults:`, so `group=option` swaps the whole node and typos fail at compose time.
    task: Any = MISSING
    model: Any = MISSING
    dataset: Any = MISSING
    loss: Any = MISSING
    precision: Any = MISSING
    strategy: Any = MISSING
    launcher: Any = MISSING
    loader: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    trainer: Any = MISSING
    early_stopping: Any = MISSING
    ema: Any = MISSING
    activation_checkpointing: Any = MISSING
    checkpoint: Any = MISSING
    quant: Any = MISSING
    paths: Any = MISSING
    distill: Any = MISSING
    prune: Any = MISSING
    selective_backprop: Any = MISSING
    lora: Any = MISSING
    # The chosen loggers by name (LOGGER_SCHEMAS); {} = metrics.jsonl only.
    logger: dict[str, Any] = field(default_factory=dict)
    # Free-form labels of the run, recorded in every logger and in summary.json.
    tags: list[str] = field(default_factory=list)
    # Loop hooks by _target_ (accel_train.techniques.Technique subclasses), by name.
    callbacks: dict[str, Any] = field(default_factory=dict)
