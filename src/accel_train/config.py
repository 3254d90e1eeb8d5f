"""Typed config schema, registered in Hydra's ConfigStore, plus the semantic checks.

The YAML files under ``configs/`` hold the values and their comments; these dataclasses
hold the types, so a misspelled key or a wrong type fails when Hydra composes the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


class UserError(ValueError):
    """A problem the user can fix (config, data, checkpoint): reported without a traceback."""


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


@dataclass
class ModelConfig:
    name: str = MISSING
    dropout: float = 0.0
    hidden_dims: list[int] = field(default_factory=list)


@dataclass
class DatasetConfig:
    name: str = MISSING
    in_channels: int = 1
    image_size: int = 28
    num_classes: int = 10
    mean: list[float] = field(default_factory=lambda: [0.5])
    std: list[float] = field(default_factory=lambda: [0.5])
    download: bool = True
    random_shift: int = 0
    random_hflip: bool = False
    num_train: int = 0
    num_val: int = 0
    seed: int = 0


@dataclass
class PrecisionConfig:
    name: str = MISSING
    tf32: bool = True


@dataclass
class StrategyConfig:
    name: str = MISSING
    backend: str = "auto"
    bucket_cap_mb: int = 25
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    reshard_after_forward: bool = True


@dataclass
class LauncherConfig:
    name: str = MISSING
    nproc_per_node: str = "1"
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"
    rdzv_id: str | None = None
    rdzv_timeout: int = 300
    max_restarts: int = 0
    monitor_interval: float = 1.0
    log_dir: str | None = None
    omp_num_threads: int | None = None
    # SLURM (launcher=slurm) only:
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 0
    mem: str | None = None
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    job_name: str | None = None
    sbatch_extra: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    signal_grace_s: int = 120
    max_requeues: int = 3
    submit: bool = True


@dataclass
class LoaderConfig:
    name: str = MISSING
    batch_size: int = 64
    eval_batch_size: int = 0
    num_workers: int = 0
    pin_memory: bool = True
    persistent_workers: bool = True
    prefetch_factor: int = 2
    drop_last: bool = False
    shuffle: bool = True


@dataclass
class OptimizerConfig:
    name: str = MISSING
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    nesterov: bool = False
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    fused: bool | None = None
    scale_lr_with_batch: bool = False
    reference_batch_size: int = 256


@dataclass
class SchedulerConfig:
    name: str = MISSING
    warmup_steps: int = 0
    step_size: int = 1000
    gamma: float = 0.1
    min_lr: float = 0.0
    max_lr: float = 0.01
    pct_start: float = 0.3


@dataclass
class TrainerConfig:
    max_epochs: int = 3
    max_steps: int = -1
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 0.0
    log_every_n_steps: int = 50
    val_every_n_epochs: int = 1
    limit_train_batches: int = 0
    limit_val_batches: int = 0
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


@dataclass
class LoggerConfig:
    name: str = MISSING


@dataclass
class PathsConfig:
    data_dir: str = MISSING
    log_dir: str = MISSING
    output_dir: str = MISSING


@dataclass
class TrainConfig:
    name: str = "train"
    resume: str | None = None
    objective: str = "best_val_acc"
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)


@dataclass
class EvalConfig:
    ckpt_path: str = MISSING
    out_path: str | None = None
    data_dir: str | None = None
    batch_size: int = 0
    device: str = "auto"


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="eval_schema", node=EvalConfig)


# The options each `name` may take; the YAML files in each group set exactly one of these.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.name": ("mnist_cnn", "mlp", "resnet18"),
    "dataset.name": ("mnist", "fashion_mnist", "cifar10", "synthetic"),
    "precision.name": ("fp32", "amp", "fp16", "bf16", "bf16_true"),
    "strategy.name": ("single", "ddp", "fsdp"),
    "strategy.backend": ("auto", "nccl", "gloo"),
    "launcher.name": ("local", "torchrun", "slurm"),
    "loader.name": ("torch", "device"),
    "optimizer.name": ("sgd", "adam", "adamw"),
    "scheduler.name": ("none", "step", "cosine", "onecycle"),
    "logger.name": ("tensorboard", "csv", "none"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.progress": ("auto", "rich", "plain", "none"),
}

# summary.json keys a sweep may optimise (`objective`), with the direction that is better.
OBJECTIVES: dict[str, str] = {
    "best_val_acc": "maximize",
    "final_val_acc": "maximize",
    "final_val_loss": "minimize",
    "train_samples_per_s": "maximize",
    "wall_s": "minimize",
}

# key: (minimum, what the key means) for integers that must be at least that.
MINIMUMS: dict[str, tuple[int, str]] = {
    "loader.batch_size": (1, "samples per device per micro-batch"),
    "loader.eval_batch_size": (0, "0 means the same as loader.batch_size"),
    "loader.num_workers": (0, "0 loads in the main process"),
    "trainer.accumulate_grad_batches": (1, "1 means no accumulation"),
    "trainer.log_every_n_steps": (1, "optimizer steps between metric lines"),
    "trainer.val_every_n_epochs": (1, "epochs between validations"),
    "trainer.ckpt_every_n_steps": (0, "0 saves only at the end of each epoch"),
    "trainer.limit_train_batches": (0, "0 means no limit"),
    "trainer.limit_val_batches": (0, "0 means no limit"),
    "trainer.profile_steps": (1, "steps recorded by the profiler"),
}


def validate(cfg: DictConfig) -> None:
    """Checks that types alone cannot express. Raises UserError naming the key and the fix."""
    if cfg.strategy.name == "dp":
        raise UserError(
            "strategy=dp (torch.nn.DataParallel) is not supported: it drives all GPUs from one "
            "Python process, scatters inputs and gathers outputs through GPU 0 every step, and is "
            "slower than DistributedDataParallel even on a single node (PyTorch's docs say so). "
            "Use `strategy=ddp launcher.nproc_per_node=auto` (one process per GPU)."
        )
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            group = key.split(".")[0]
            raise UserError(
                f"{key}={value!r} is not one of {', '.join(allowed)}. "
                f"Pick a {group} option, e.g. `{group}={allowed[0]}`."
            )
    for key, (minimum, meaning) in MINIMUMS.items():
        value = OmegaConf.select(cfg, key)
        if value < minimum:
            fix = f"`{key}={max(minimum, 1)}`"
            raise UserError(f"{key}={value} must be >= {minimum} ({meaning}). Set e.g. {fix}.")
    t = cfg.trainer
    if t.max_epochs < 1 and t.max_steps < 1:
        raise UserError(
            f"trainer.max_epochs={t.max_epochs} and trainer.max_steps={t.max_steps}: nothing to "
            "train. Set `trainer.max_epochs=1` or more, or `trainer.max_steps=1` or more."
        )
    if t.gradient_clip_val < 0:
        raise UserError(
            f"trainer.gradient_clip_val={t.gradient_clip_val} must be >= 0 (0 turns clipping off)."
        )
    if cfg.optimizer.lr <= 0:
        raise UserError(f"optimizer.lr={cfg.optimizer.lr} must be > 0, e.g. `optimizer.lr=1e-3`.")
    if cfg.loader.name == "torch" and cfg.loader.prefetch_factor < 1:
        raise UserError("loader.prefetch_factor must be >= 1 (batches loaded ahead per worker).")
    if cfg.objective not in OBJECTIVES:
        raise UserError(
            f"objective={cfg.objective!r} is not a summary.json metric: pick one of "
            f"{', '.join(OBJECTIVES)} (e.g. `objective=best_val_acc`)."
        )
    # A checkpoint is a .pt file, or (FSDP) a .dcp directory holding meta.pt.
    if cfg.resume not in (None, "auto") and not (
        Path(cfg.resume).is_file() or (Path(cfg.resume) / "meta.pt").is_file()
    ):
        raise UserError(
            f"resume={cfg.resume!r}: no such checkpoint. Give a path to a .pt file (or an FSDP "
            ".dcp directory) written by accel-train, or `resume=auto` to continue from the run "
            "directory's last checkpoint."
        )


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python types (what checkpoints store)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    return container


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: dotted keys, to name the first key two configs differ in."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_run_config(path: str | Path) -> DictConfig:
    """Load a resolved config written by the launcher, typed against the schema again."""
    schema = OmegaConf.structured(TrainConfig)
    loaded = OmegaConf.load(path)
    cfg = OmegaConf.merge(schema, loaded)
    assert isinstance(cfg, DictConfig)
    return cfg
