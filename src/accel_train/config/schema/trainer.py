"""trainer (the loop's settings) and early_stopping: one option each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class ProgressiveResizeConfig:
    """trainer.progressive_resize: FFCV's schedule of training image sizes
    (data/images/sample_recipe.py)."""

    start_size: int = 160
    end_size: int = 192
    start_epoch: int = 0
    end_epoch: int = 1
    step: int = 32


@dataclass
class HarnessConfig:
    """lm-evaluation-harness tasks: accel-eval's `harness` and the training's `trainer.harness`
    (run every trainer.harness_every_n_steps), one type so both spell the keys alike."""

    tasks: list[str] = field(default_factory=list)
    include_path: str | None = None
    limit: Any = None  # int: documents per task; float in (0, 1): a fraction; null = all
    num_fewshot: int | None = None
    batch_size: int = 8
    chat: bool = False


@dataclass
class TrainerConfig:
    name: str = "default"
    max_epochs: int = 3
    max_steps: int = -1
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 0.0
    log_every_n_steps: int = 0
    val_every_n_epochs: int = 1
    limit_train_batches: Any = 0  # int: batches; float in (0, 1]: a fraction (Lightning's)
    limit_val_batches: Any = 0
    limit_test_batches: Any = 0
    val_check_interval: Any = 1.0  # float in (0, 1]: fraction of an epoch; int: optimizer steps
    stop_at: str | None = None
    target: str | None = None
    test_after_fit: bool = True
    seed: int = 42
    deterministic: bool = False
    compile: bool = False
    channels_last: bool = False
    ckpt_every_n_steps: int = 0
    device: str = "auto"
    profile: bool = False
    profile_steps: int = 5
    progress: str = "auto"
    tune_malloc: bool = True
    on_nonfinite: str = "stop"
    peak_flops: float = 0.0
    plot_curves: bool = True
    memory_fraction: float = 0.9
    global_batch_size: int = 0
    # FFCV's progressive resizing (issue 38): null or a dict of ProgressiveResizeConfig's keys,
    # untyped here because OmegaConf cannot merge a command line's dict into a null dataclass
    # node; config/recipe_checks.py checks it against ProgressiveResizeConfig.
    progressive_resize: Any = None
    harness_every_n_steps: int = 0
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    sample_every_n_steps: int = 0
    sample_prompts: Any = None  # a list of prompts, or the path of a .txt / .jsonl file of them
    sample_max_new_tokens: int = 64
    sample_temperature: float = 0.0


@dataclass
class EarlyStoppingConfig:
    name: str = MISSING
    monitor: str | None = None
    mode: str = "max"
    patience: int = 3
    min_delta: float = 0.0
