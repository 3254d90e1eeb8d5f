"""task: what a training step computes and what validation scores (accel_train/tasks/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class TaskConfig:
    _target_: str = MISSING
    name: str = "custom"
    # checkpoint.monitor's default: the validation metric that ranks this task's checkpoints.
    monitor: str = "val/loss"
    monitor_mode: str = "min"
    # objective's default: the summary.json metric a sweep job returns.
    objective: str = "final_val_loss"


@dataclass
class ClassificationTaskConfig(TaskConfig):
    monitor: str = "val/acc"
    monitor_mode: str = "max"
    objective: str = "best_val_acc"
    top_k: list[int] | None = None  # None: [1, 5] with >= 10 classes, else [1]


@dataclass
class RegressionTaskConfig(TaskConfig):
    loss: str = "mse"
    huber_delta: float = 1.0
    input_key: str = "x"
    target_key: str = "y"


@dataclass
class SegmentationTaskConfig(TaskConfig):
    # tasks/segmentation.py (issue 63); the defaults are configs/task/segmentation.yaml's.
    monitor: str = "val/dice"
    monitor_mode: str = "max"
    loss: str = "dice_ce"
    include_background: bool = True
    roi_size: list[int] | None = None
    sw_batch_size: int = 4
    overlap: float = 0.25
    sw_mode: str = "constant"
    loss_args: dict[str, Any] = field(default_factory=dict)


@dataclass
class LanguageModelTaskConfig(TaskConfig):
    ignore_index: int = -1
    sample_lines: int = 0
    sample_tokens: int = 64
    chunked_loss: bool = False
    loss_chunk_tokens: int = 1024
    z_loss: float = 0.0
    label_smoothing: float = 0.0


class PreferenceTaskConfig(TaskConfig):  # made a dataclass below, with `lambda`
    loss: str = "dpo"
    beta: float = 0.1
    gamma: float = 0.5
    label_smoothing: float = 0.0
    precompute_reference: bool = False
    ignore_index: int = -100


# ORPO's weight `task.lambda`: a Python keyword cannot be a dataclass field written in the class
# body (the generated __init__, __repr__ and __eq__ would name it), so it is added as a field
# outside them; OmegaConf types and validates it like the others.
PreferenceTaskConfig.__annotations__["lambda"] = float
setattr(PreferenceTaskConfig, "lambda", field(default=0.1, init=False, repr=False, compare=False))
PreferenceTaskConfig = dataclass(PreferenceTaskConfig)


@dataclass
class GrpoTaskConfig(TaskConfig):
    monitor: str = "val/reward"
    monitor_mode: str = "max"
    objective: str = "final_val_loss"
    num_generations: int = 8
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    importance_sampling_level: str = "token"
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    use_bias_correction_kl: bool = True
    rewards: list[Any] = field(default_factory=list)
    reward_timeout_s: float | None = None
    log_completions: bool = True
    num_completions_to_print: int | None = 8
    generation: str = "hf"
    chunked_loss: bool = True
    loss_chunk_tokens: int = 1024
    generation_batch_size: int | None = None
    seed: int = 0


@dataclass
class CustomTaskConfig(TaskConfig):
    step: str = MISSING
    eval_step: str | None = None
    metrics: dict[str, str] = field(default_factory=dict)
