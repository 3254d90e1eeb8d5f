"""The typed config schema: one dataclass per option, registered in Hydra's ConfigStore.

Each option's YAML under ``configs/<group>/`` starts with ``defaults: [<option>_schema]``, so it
holds only its own keys, a misspelled key or a wrong type fails when Hydra composes, and a local
run's config tree carries no SLURM keys. Options whose code the user brings (``model``,
``dataset``, ``loss``, ``callbacks``) are built by ``_target_`` with ``hydra.utils.instantiate``;
their extra constructor arguments are added with ``+group.key=value``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from omegaconf import MISSING

from accel_train.config.lazy_store import store_lazily
from accel_train.config.sweeper import register_optuna_sweeper

# ---- model: a class or factory by _target_; the data shape is passed where accepted -------


@dataclass
class ModelConfig:
    _target_: str = MISSING
    name: str = "custom"  # this option's name (model=timm and torchvision: the architecture)
    # Every model: a state dict loaded before training, and parameters frozen by name.
    weights: str | None = None
    freeze: list[str] = field(default_factory=list)


@dataclass
class MnistCnnConfig(ModelConfig):
    dropout: float = 0.25
    hidden_dim: int = 128


@dataclass
class SmallCnnConfig(ModelConfig):
    dropout: float = 0.25
    hidden_dim: int = 256


@dataclass
class VideoCnnConfig(ModelConfig):
    width: int = 16
    dropout: float = 0.0


@dataclass
class MlpConfig(ModelConfig):
    dropout: float = 0.1
    hidden_dims: list[int] = field(default_factory=lambda: [512, 256])


@dataclass
class Resnet18Config(ModelConfig):
    stem: str = "auto"


@dataclass
class GptConfig(ModelConfig):
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False
    pos_embedding: str = "learned"
    rope_base: float = 10000.0
    qk_norm: bool = False
    activation: str = "gelu"
    tie_embeddings: bool = True


@dataclass
class HfModelConfig(ModelConfig):
    path: str = MISSING
    head: str = "causal_lm"
    pretrained: bool = True
    attn_implementation: str = "sdpa"
    liger: bool = False


# Models by name from the vision libraries (models/timm.py, models/torchvision.py): `name` is
# the architecture, not the option; the option is known by its `_target_` (config/run_config.py).
# Their own keyword arguments go through untyped: `+model.drop_path_rate=0.1`.


@dataclass
class TimmModelConfig(ModelConfig):
    _target_: str = "accel_train.models.timm.timm_model"
    name: str = MISSING


@dataclass
class TorchvisionModelConfig(ModelConfig):
    _target_: str = "accel_train.models.torchvision.torchvision_model"
    name: str = MISSING


# ---- dataset: a factory by _target_ returning the splits ---------------------------------

# Keys every dataset option has that accel-train itself consumes (not passed to the factory
# unless its signature names them).
DATASET_COMMON_KEYS = ("name", "num_classes", "mean", "std", "random_shift", "random_hflip")


@dataclass
class DatasetConfig:
    _target_: str = MISSING
    name: str = "custom"
    num_classes: int | None = None
    mean: list[float] = field(default_factory=lambda: [0.5])
    std: list[float] = field(default_factory=lambda: [0.5])
    random_shift: int = 0
    random_hflip: bool = False
    val_fraction: float = 0.1
    seed: int = 0


@dataclass
class TorchvisionDatasetConfig(DatasetConfig):
    download: bool = True


@dataclass
class SyntheticDatasetConfig(DatasetConfig):
    in_channels: int = 1
    image_size: int = 28
    num_train: int = 2048
    num_test: int = 512


@dataclass
class TokensDatasetConfig(DatasetConfig):
    path: str = MISSING
    block_size: int = 256
    windows_per_epoch: int = 0
    eval_windows: int = 200
    document_separator: int | None = None


@dataclass
class SftDatasetConfig(DatasetConfig):
    path: str = MISSING
    val_path: str | None = None
    test_path: str | None = None
    tokenizer: str | None = None
    max_length: int = 1024
    pack: bool = False
    train_on: str = "completion"
    ignore_index: int = -100
    trim_padding: bool = True
    chat_template: str | None = None


@dataclass
class PreferenceDatasetConfig(DatasetConfig):
    path: str = MISSING
    val_path: str | None = None
    test_path: str | None = None
    tokenizer: str | None = None
    max_length: int = 1024
    max_prompt_length: int | None = 512
    ignore_index: int = -100
    chat_template: str | None = None


@dataclass
class PromptsDatasetConfig(DatasetConfig):
    path: str = MISSING
    val_path: str | None = None
    test_path: str | None = None
    tokenizer: str | None = None
    max_prompt_length: int | None = 512
    chat_template: str | None = None
    num_iterations: int = 1
    accumulate_grad_batches: int = 1


# The recipe switches of issue 38 (timm's spellings; data/recipe.py, data/batch_mix.py): keys
# accel-train consumes itself, never passed to the dataset's factory.
@dataclass
class RecipeDatasetConfig:
    auto_augment: str | None = None
    random_erasing: float = 0.0
    random_erasing_mode: str = "pixel"
    random_erasing_count: int = 1
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = "batch"


DATASET_RECIPE_KEYS = tuple(f.name for f in fields(RecipeDatasetConfig))


@dataclass
class ImageFolderDatasetConfig(RecipeDatasetConfig, DatasetConfig):
    root: str = MISSING
    train_split: str = "train"
    # Which folder is which split: data/image_tree.py (issue 47).
    val_split: str | None = "val"
    test_split: str | None = "test"
    holdout: bool = False
    image_size: int = 64
    resize_size: int = 0
    augment: str = "cpu"
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    cache: str = "none"
    cache_dir: str | None = None
    # Photos at full size (issue 38; docs/vision.md).
    eval_image_size: int | None = None
    crop_pct: float = 0.875
    interpolation: str = "bilinear"
    decode: str = "cpu"
    check_images: bool = True


@dataclass
class VideoFolderDatasetConfig(DatasetConfig):
    # data/video_folder.py (issue 49); the defaults are configs/dataset/video_folder.yaml's.
    root: str = MISSING
    list_file: str | None = None
    val_list_file: str | None = None
    test_list_file: str | None = None
    train_split: str = "train"
    val_split: str | None = "val"
    test_split: str | None = "test"
    holdout: bool = False
    frames: int = 16
    frame_stride: int = 2
    fps: float | None = None
    image_size: int = 112
    resize_size: int = 128
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    eval_clips: int = 5
    eval_crops: int = 1
    decode_threads: int = 1
    decode: str = "cpu"
    pad_short: bool = False
    shuffle_frames: bool = False
    metadata_cache: str | None = None


@dataclass
class StreamingVideoDatasetConfig(DatasetConfig):
    # data/streaming_video.py: video shards, clips drawn as dataset=video_folder draws them.
    remote: str = MISSING
    local: str | None = None
    cache_limit: str = "20gb"
    frames: int = 16
    frame_stride: int = 2
    fps: float | None = None
    image_size: int = 112
    resize_size: int = 128
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    eval_clips: int = 5
    eval_crops: int = 1
    decode_threads: int = 1
    decode: str = "cpu"
    pad_short: bool = False
    shuffle_frames: bool = False


@dataclass
class StreamingDatasetConfig(DatasetConfig):
    remote: str = MISSING
    local: str | None = None
    cache_limit: str = "20gb"
    image_size: int = 64
    resize_size: int = 0
    augment: str = "cpu"
    crop_scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    # Photos at full size (issue 38; docs/vision.md).
    eval_image_size: int | None = None
    crop_pct: float = 0.875
    interpolation: str = "bilinear"


@dataclass
class StreamingSftDatasetConfig(DatasetConfig):
    remote: str = MISSING
    tokenizer: str | None = None
    local: str | None = None
    cache_limit: str = "20gb"
    ignore_index: int = -100
    max_length: int | None = None
    pack: bool | None = None
    chat_template: str | None = None


@dataclass
class StreamingPreferenceDatasetConfig(DatasetConfig):
    remote: str = MISSING
    tokenizer: str | None = None
    local: str | None = None
    cache_limit: str = "20gb"
    ignore_index: int = -100
    max_length: int | None = None
    max_prompt_length: int | None = None
    chat_template: str | None = None


@dataclass
class StreamingTokensDatasetConfig(DatasetConfig):
    remote: str = MISSING
    local: str | None = None
    cache_limit: str = "20gb"
    block_size: int = 256
    eval_windows: int = 200


# ---- loss -------------------------------------------------------------------------------


@dataclass
class LossConfig:
    _target_: str = MISSING
    name: str = "custom"


@dataclass
class CrossEntropyConfig(LossConfig):
    label_smoothing: float = 0.0


# ---- task: what a training step computes and what validation scores (accel_train/tasks/) ---


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
    log_completions: bool = True
    num_completions_to_print: int | None = 8
    generation: str = "hf"
    chunked_loss: bool = False
    loss_chunk_tokens: int = 1024
    seed: int = 0


@dataclass
class CustomTaskConfig(TaskConfig):
    step: str = MISSING
    eval_step: str | None = None
    metrics: dict[str, str] = field(default_factory=dict)


# ---- precision, strategy, launcher, loader ----------------------------------------------


@dataclass
class PrecisionConfig:
    name: str = MISSING
    tf32: bool = True


@dataclass
class StrategyConfig:
    name: str = MISSING
    backend: str = "auto"


@dataclass
class DdpConfig(StrategyConfig):
    bucket_cap_mb: int = 25
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False


@dataclass
class FsdpConfig(StrategyConfig):
    reshard_after_forward: bool = True
    wrap_classes: list[str] = field(default_factory=list)
    tp: int = 1
    sequence_parallel: bool = False
    tp_plan: dict[Any, str] = field(default_factory=dict)  # int keys: a Sequential's layers
    cp: int = 1


@dataclass
class TpConfig(StrategyConfig):
    tp: int = 0
    sequence_parallel: bool = False
    tp_plan: dict[Any, str] = field(default_factory=dict)  # int keys: a Sequential's layers


@dataclass
class PipelineConfig(StrategyConfig):
    stages: int = 0
    schedule: str = "1f1b"
    microbatches: int = 4
    split_points: list[str] = field(default_factory=list)


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


@dataclass
class SlurmLauncherConfig(LauncherConfig):
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
class RayLauncherConfig(LauncherConfig):
    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    address: str | None = None
    submit: str = "none"
    max_failures: int = 0
    runtime_env: dict[str, Any] = field(default_factory=dict)
    python: str = "python"


@dataclass
class KubernetesLauncherConfig(LauncherConfig):
    kind: str = "trainjob"
    image: str | None = None
    nodes: int = 1
    gpus_per_node: int = 0
    cpu: str | None = None
    memory: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    image_pull_secrets: list[str] = field(default_factory=list)
    volume: str | None = None
    mount_path: str = "/runs"
    namespace: str = "default"
    job_name: str | None = None
    runtime: str = "torch-distributed"
    submit: bool = False
    context: str | None = None


@dataclass
class LoaderConfig:
    name: str = MISSING
    # An int >= 1, or "auto" (probed before training: train/auto_batch.py); checked in
    # config/checks.py, since OmegaConf 2.3 has no int-or-str type.
    batch_size: Any = 64
    max_batch_size: int = 1024
    eval_batch_size: int = 0
    drop_last: bool = False
    shuffle: bool = True


@dataclass
class TorchLoaderConfig(LoaderConfig):
    num_workers: int = 0
    pin_memory: bool = True
    persistent_workers: bool = True
    prefetch_factor: int = 2
    multiprocessing_context: str | None = None


@dataclass
class RayLoaderConfig(LoaderConfig):
    num_workers: int = 2
    cpus_per_worker: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)
    address: str | None = None
    prefetch: int = 4
    max_restarts: int = 3
    retries: int = 3
    timeout_s: float = 120.0
    object_store_mb: int | None = None
    runtime_env: dict[str, Any] = field(default_factory=dict)
    pin_memory: bool = True


# ---- optimizer, scheduler ---------------------------------------------------------------


@dataclass
class OptimizerConfig:
    name: str = MISSING
    lr: float = 1e-3
    weight_decay: float = 0.0
    fused: bool | None = None
    scale_lr_with_batch: bool = False
    reference_batch_size: int = 256
    layer_decay: float | None = None  # timm's layer-wise lr decay (optim.py; issue 38)


@dataclass
class SgdConfig(OptimizerConfig):
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class AdamConfig(OptimizerConfig):
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class MuonConfig(OptimizerConfig):
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    adamw_lr: float = 1e-3
    adamw_weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8


@dataclass
class SchedulerConfig:
    name: str = MISSING
    warmup_steps: int = 0


@dataclass
class StepSchedulerConfig(SchedulerConfig):
    step_size: int = 1000
    gamma: float = 0.1


@dataclass
class CosineSchedulerConfig(SchedulerConfig):
    min_lr: float = 0.0


@dataclass
class OneCycleSchedulerConfig(SchedulerConfig):
    max_lr: float = 0.01
    pct_start: float = 0.3
    anneal_strategy: str = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1.0e4


# ---- quant: quantization-aware training (techniques/qat.py) -----------------------------


@dataclass
class QuantConfig:
    name: str = MISSING


@dataclass
class QatConfig(QuantConfig):
    weight_bits: int = 8
    group_size: int = 0


# ---- trainer, logger, paths: one option each --------------------------------------------


@dataclass
class ProgressiveResizeConfig:
    """trainer.progressive_resize: FFCV's schedule of training image sizes (data/recipe.py)."""

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


# ---- compression techniques: one typed group each, off at their neutral value -----------


@dataclass
class DistillConfig:
    name: str = "default"
    # A teacher checkpoint path (.pt, or an FSDP .dcp dir), or a model node with a _target_.
    teacher: Any = None
    alpha: float = 0.5
    temperature: float = 4.0


@dataclass
class PruneScheduleConfig:
    start: float = 0.0
    end: float = 0.8
    ramp: str = "cubic"
    every_n_steps: int = 10


@dataclass
class PruneConfig:
    name: str = "default"
    amount: float = 0.0
    method: str = "unstructured"
    scope: str = "global"
    schedule: PruneScheduleConfig = field(default_factory=PruneScheduleConfig)


@dataclass
class SelectiveBackpropConfig:
    name: str = "default"
    keep: float = 1.0
    start: float = 0.5
    end: float = 0.9
    interrupt: int = 2


# Loggers: each option sits under its own key (`logger.csv`, `logger.mlflow`, ...), as in
# lightning-hydra-template, so that several chosen at once (`logger=[csv,mlflow]`) do not
# overwrite each other; `cfg.logger` maps each chosen logger to its settings.


@dataclass
class CheckpointConfig:
    """Which checkpoint files a run keeps (Lightning's ModelCheckpoint keys)."""

    name: str = "default"
    monitor: str = "val/acc"
    mode: str = "max"
    save_top_k: int = 1
    filename: str | None = None
    every_n_epochs: int = 1
    save_last: bool = True
    async_save: bool = False


@dataclass
class CsvLoggerConfig:
    pass


@dataclass
class TensorboardLoggerConfig:
    pass


@dataclass
class MlflowLoggerConfig:
    tracking_uri: str | None = None
    experiment_name: str = MISSING
    run_name: str | None = None


@dataclass
class WandbLoggerConfig:
    project: str = "accel-train"
    entity: str | None = None
    mode: str = "offline"
    group: str | None = None
    run_name: str | None = None


LOGGER_SCHEMAS: dict[str, type] = {
    "csv": CsvLoggerConfig,
    "tensorboard": TensorboardLoggerConfig,
    "mlflow": MlflowLoggerConfig,
    "wandb": WandbLoggerConfig,
}


@dataclass
class EmaConfig:
    name: str = "default"
    enabled: bool = False
    decay: float = 0.999
    every_n_steps: int = 1
    start_step: int = 0
    warmup: bool = True


@dataclass
class LoraConfig:
    name: str = "default"
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target: list[str] = field(default_factory=list)
    base_dtype: str | None = None


@dataclass
class ActivationCheckpointingConfig:
    name: str = "default"
    mode: str = "off"
    every: int = 2
    classes: list[str] = field(default_factory=list)
    offload: bool = False


@dataclass
class PathsConfig:
    name: str = "default"
    data_dir: str = MISSING
    log_dir: str = MISSING
    output_dir: str = MISSING


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


@dataclass
class EvalConfig:
    ckpt_path: str = MISSING
    model_path: str | None = None
    split: str | None = None
    data_path: str | None = None
    out_path: str | None = None
    data_dir: str | None = None
    batch_size: int = 0
    device: str = "auto"
    harness: HarnessConfig = field(default_factory=HarnessConfig)


@dataclass
class ExportConfig:
    ckpt_path: str = MISSING
    format: str = "onnx"
    quantize: str = "none"
    out_path: str | None = None
    data_dir: str | None = None
    batch_size: int = 0
    verify_samples: int = 0
    calib_batches: int = 8
    min_agreement: float = 0.999
    overwrite: bool = False


@dataclass
class SampleConfig:
    ckpt_path: str = MISSING
    prompt: str = ""
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1
    num_samples: int = 1
    data_dir: str | None = None
    device: str = "auto"
    chat: bool = False
    system: str | None = None


@dataclass
class TokenizeConfig:
    input: str = MISSING
    out: str = MISSING
    tokenizer: str = "char"
    vocab_size: int = 8192
    val_fraction: float = 0.1
    overwrite: bool = False


@dataclass
class ShardConfig:
    dataset: Any = MISSING
    task: Any = None  # what dataset=tokens picks for training (its defaults list): unused here
    out: str = MISSING
    chunk_bytes: str = "64MB"
    num_workers: int = 1
    overwrite: bool = False
    max_side: int = 0  # image folders: re-encode images whose longer side is above it (0: never)
    jpeg_quality: int = 90  # the JPEG quality of those re-encoded images
    fps: float = 0.0  # video folders: keep at most this frame rate (0: every frame)
    crf: int = 23  # video folders: libx264's quality of the re-encoded videos
    gop: int | None = None  # video folders: most frames between key frames (None: 32 if re-encoded)


# group -> option name -> schema. The option names are the YAML files' `name:` values; an
# option a user adds in their own config dir (hydra.searchpath) may use any name and is typed
# by the group's base schema when it names one of these, untyped otherwise.
OPTION_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {
        "mnist_cnn": MnistCnnConfig,
        "small_cnn": SmallCnnConfig,
        "video_cnn": VideoCnnConfig,
        "mlp": MlpConfig,
        "resnet18": Resnet18Config,
        "gpt": GptConfig,
        "hf": HfModelConfig,
        "timm": TimmModelConfig,
        "torchvision": TorchvisionModelConfig,
        "custom": ModelConfig,
    },
    "dataset": {
        "mnist": TorchvisionDatasetConfig,
        "fashion_mnist": TorchvisionDatasetConfig,
        "cifar10": TorchvisionDatasetConfig,
        "synthetic": SyntheticDatasetConfig,
        "image_folder": ImageFolderDatasetConfig,
        "video_folder": VideoFolderDatasetConfig,
        "streaming_video": StreamingVideoDatasetConfig,
        "tokens": TokensDatasetConfig,
        "sft": SftDatasetConfig,
        "preference": PreferenceDatasetConfig,
        "prompts": PromptsDatasetConfig,
        "streaming_preference": StreamingPreferenceDatasetConfig,
        "streaming_sft": StreamingSftDatasetConfig,
        "streaming": StreamingDatasetConfig,
        "streaming_tokens": StreamingTokensDatasetConfig,
        "custom": DatasetConfig,
    },
    "loss": {"cross_entropy": CrossEntropyConfig, "custom": LossConfig},
    "task": {
        "classification": ClassificationTaskConfig,
        "regression": RegressionTaskConfig,
        "model_loss": TaskConfig,
        "language_model": LanguageModelTaskConfig,
        "preference": PreferenceTaskConfig,
        "grpo": GrpoTaskConfig,
        "custom": CustomTaskConfig,
    },
    "precision": {n: PrecisionConfig for n in ("fp32", "amp", "fp16", "bf16", "bf16_true")},
    "strategy": {
        "single": StrategyConfig,
        "ddp": DdpConfig,
        "fsdp": FsdpConfig,
        "tp": TpConfig,
        "pipeline": PipelineConfig,
        "dp": StrategyConfig,
    },
    "launcher": {
        "local": LauncherConfig,
        "torchrun": LauncherConfig,
        "slurm": SlurmLauncherConfig,
        "ray": RayLauncherConfig,
        "kubernetes": KubernetesLauncherConfig,
    },
    "loader": {"torch": TorchLoaderConfig, "device": LoaderConfig, "ray": RayLoaderConfig},
    "optimizer": {"sgd": SgdConfig, "adam": AdamConfig, "adamw": AdamConfig, "muon": MuonConfig},
    "scheduler": {
        "none": SchedulerConfig,
        "step": StepSchedulerConfig,
        "cosine": CosineSchedulerConfig,
        "onecycle": OneCycleSchedulerConfig,
    },
    "early_stopping": {"default": EarlyStoppingConfig},
    "quant": {"none": QuantConfig, "qat": QatConfig},
    "trainer": {"default": TrainerConfig},
    "ema": {"default": EmaConfig},
    "lora": {"default": LoraConfig},
    "activation_checkpointing": {"default": ActivationCheckpointingConfig},
    "checkpoint": {"default": CheckpointConfig},
    "paths": {"default": PathsConfig},
    "distill": {"default": DistillConfig},
    "prune": {"default": PruneConfig},
    "selective_backprop": {"default": SelectiveBackpropConfig},
}


# ---- hydra/launcher=submitit_slurm: Hydra's submitit plugin (the `slurm` extra) -------------

try:
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
except ImportError:  # not installed: commands/sweep_summary.check_plugins names the extra
    SlurmQueueConf = None

if SlurmQueueConf is not None:

    @dataclass
    class SubmititSlurmConfig(SlurmQueueConf):
        """The plugin's `submitit_slurm` option with two changes (every other key and default is
        the plugin's): its SlurmLauncher with errors that name the key to set, and requeues
        after the time limit, since every sweep job resumes from its last.pt when requeued."""

        # the plugin's SlurmLauncher, reporting refused submissions and lost jobs as UserErrors
        _target_: str = "hydra_plugins.accel_train_submitit.SlurmLauncher"
        # requeues after reaching the time limit (the plugin's 0 ends a timed-out job; a
        # preempted job is always requeued), as launcher=slurm's max_requeues
        max_num_timeout: int = 3


def schema_name(schema: type) -> str:
    """The ConfigStore name an option's YAML lists in its defaults, e.g. `ddp_config`."""
    name = schema.__name__.removesuffix("Config")
    snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
    return f"{snake}_schema"


def register_configs() -> None:
    cs = ConfigStore.instance()
    # Converted when a compose first reads them (config/lazy_store.py): a run reads ~20 of them.
    store_lazily("train_schema", TrainConfig)
    store_lazily("eval_schema", EvalConfig)
    store_lazily("export_schema", ExportConfig)
    store_lazily("tokenize_schema", TokenizeConfig)
    store_lazily("shard_schema", ShardConfig)
    store_lazily("sample_schema", SampleConfig)
    for group, options in OPTION_SCHEMAS.items():
        for schema in set(options.values()):
            store_lazily(schema_name(schema), schema, group)
    for name, schema in LOGGER_SCHEMAS.items():  # logger/csv.yaml: `defaults: [csv_schema]`
        store_lazily(f"{name}_schema", {name: schema}, "logger")
    if SlurmQueueConf is not None:
        # Replaces the plugin's own node. Hydra's plugin scan runs the plugin's config module
        # again (storing its node again), so it runs first: Hydra does it at start-up anyway and
        # keeps the result (a singleton), ~50 ms.
        Plugins.instance()
        cs.store(
            group="hydra/launcher",
            name="submitit_slurm",
            node=SubmititSlurmConfig,
            provider="accel_train",
        )
    # hydra/sweeper=optuna: ours (config/sweeper.py), also over the node of an old
    # hydra-optuna-sweeper still installed beside it (stored after the plugin scan).
    Plugins.instance()
    register_optuna_sweeper()
