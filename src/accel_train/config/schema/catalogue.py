"""The one place every schema is named: `OPTION_SCHEMAS` (each group's options and their
dataclasses) and `register_configs`, which stores them all in Hydra's ConfigStore (lazily:
config/lazy_store.py). A group's dataclasses live in their own module of this package."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins

from accel_train.config.lazy_store import store_lazily
from accel_train.config.schema import submitit
from accel_train.config.schema.checkpoint import CheckpointConfig
from accel_train.config.schema.commands import (
    ConvertConfig,
    EvalConfig,
    ExportConfig,
    SampleConfig,
    ShardConfig,
    TokenizeConfig,
)
from accel_train.config.schema.dataset import (
    AudioFolderDatasetConfig,
    DatasetConfig,
    ImageFolderDatasetConfig,
    MaskFolderDatasetConfig,
    PreferenceDatasetConfig,
    PromptsDatasetConfig,
    SftDatasetConfig,
    SignalArraysDatasetConfig,
    StreamingDatasetConfig,
    StreamingPreferenceDatasetConfig,
    StreamingSftDatasetConfig,
    StreamingTokensDatasetConfig,
    StreamingVideoDatasetConfig,
    SyntheticDatasetConfig,
    TokensDatasetConfig,
    TorchvisionDatasetConfig,
    VideoFolderDatasetConfig,
    VolumeFolderDatasetConfig,
)
from accel_train.config.schema.launcher import (
    KubernetesLauncherConfig,
    LauncherConfig,
    RayLauncherConfig,
    SlurmLauncherConfig,
)
from accel_train.config.schema.loader import LoaderConfig, RayLoaderConfig, TorchLoaderConfig
from accel_train.config.schema.logger import LOGGER_SCHEMAS
from accel_train.config.schema.loss import CrossEntropyConfig, LossConfig
from accel_train.config.schema.model import (
    GptConfig,
    HfModelConfig,
    MlpConfig,
    MnistCnnConfig,
    ModelConfig,
    MonaiModelConfig,
    Resnet1dConfig,
    Resnet18Config,
    SmallCnnConfig,
    SmpModelConfig,
    SpecCnnConfig,
    TimmModelConfig,
    TorchvisionModelConfig,
    VideoCnnConfig,
)
from accel_train.config.schema.optimizer import AdamConfig, MuonConfig, SgdConfig
from accel_train.config.schema.paths import PathsConfig
from accel_train.config.schema.precision import PrecisionConfig
from accel_train.config.schema.scheduler import (
    CosineSchedulerConfig,
    OneCycleSchedulerConfig,
    SchedulerConfig,
    StepSchedulerConfig,
)
from accel_train.config.schema.strategy import (
    DdpConfig,
    FsdpConfig,
    PipelineConfig,
    StrategyConfig,
    TpConfig,
)
from accel_train.config.schema.task import (
    ClassificationTaskConfig,
    CustomTaskConfig,
    GrpoTaskConfig,
    LanguageModelTaskConfig,
    PreferenceTaskConfig,
    RegressionTaskConfig,
    SegmentationTaskConfig,
    TaskConfig,
)
from accel_train.config.schema.techniques import (
    ActivationCheckpointingConfig,
    DistillConfig,
    EmaConfig,
    LoraConfig,
    PruneConfig,
    QatConfig,
    QuantConfig,
    SelectiveBackpropConfig,
)
from accel_train.config.schema.train import TrainConfig
from accel_train.config.schema.trainer import EarlyStoppingConfig, TrainerConfig
from accel_train.config.sweeper import register_optuna_sweeper

# group -> option name -> schema. The option names are the YAML files' `name:` values; an
# option a user adds in their own config dir (hydra.searchpath) may use any name and is typed
# by the group's base schema when it names one of these, untyped otherwise.
OPTION_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {
        "mnist_cnn": MnistCnnConfig,
        "small_cnn": SmallCnnConfig,
        "video_cnn": VideoCnnConfig,
        "resnet1d": Resnet1dConfig,
        "spec_cnn": SpecCnnConfig,
        "mlp": MlpConfig,
        "resnet18": Resnet18Config,
        "gpt": GptConfig,
        "hf": HfModelConfig,
        "timm": TimmModelConfig,
        "torchvision": TorchvisionModelConfig,
        "monai": MonaiModelConfig,
        "smp": SmpModelConfig,
        "custom": ModelConfig,
    },
    "dataset": {
        "mnist": TorchvisionDatasetConfig,
        "fashion_mnist": TorchvisionDatasetConfig,
        "cifar10": TorchvisionDatasetConfig,
        "synthetic": SyntheticDatasetConfig,
        "image_folder": ImageFolderDatasetConfig,
        "video_folder": VideoFolderDatasetConfig,
        "volume_folder": VolumeFolderDatasetConfig,
        "mask_folder": MaskFolderDatasetConfig,
        "signal_arrays": SignalArraysDatasetConfig,
        "audio_folder": AudioFolderDatasetConfig,
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
        "segmentation": SegmentationTaskConfig,
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
    store_lazily("convert_schema", ConvertConfig)
    store_lazily("sample_schema", SampleConfig)
    for group, options in OPTION_SCHEMAS.items():
        for schema in set(options.values()):
            store_lazily(schema_name(schema), schema, group)
    for name, schema in LOGGER_SCHEMAS.items():  # logger/csv.yaml: `defaults: [csv_schema]`
        store_lazily(f"{name}_schema", {name: schema}, "logger")
    if submitit.SlurmQueueConf is not None:
        # Replaces the plugin's own node. Hydra's plugin scan runs the plugin's config module
        # again (storing its node again), so it runs first: Hydra does it at start-up anyway and
        # keeps the result (a singleton), ~50 ms.
        Plugins.instance()
        cs.store(
            group="hydra/launcher",
            name="submitit_slurm",
            node=submitit.SubmititSlurmConfig,
            provider="accel_train",
        )
    # hydra/sweeper=optuna: ours (config/sweeper.py), also over the node of an old
    # hydra-optuna-sweeper still installed beside it (stored after the plugin scan).
    Plugins.instance()
    register_optuna_sweeper()
