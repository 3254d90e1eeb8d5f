"""The typed config schema: one dataclass per option, registered in Hydra's ConfigStore.

Each option's YAML under ``configs/<group>/`` starts with ``defaults: [<option>_schema]``, so it
holds only its own keys, a misspelled key or a wrong type fails when Hydra composes, and a local
run's config tree carries no SLURM keys. Options whose code the user brings (``model``,
``dataset``, ``loss``, ``callbacks``) are built by ``_target_`` with ``hydra.utils.instantiate``;
their extra constructor arguments are added with ``+group.key=value``.

One module per group (``model.py``, ``dataset.py``, ``strategy.py``, ...; the techniques' small
groups share ``techniques.py``, the other commands' roots ``commands.py``), and one catalogue
(``catalogue.py``: ``OPTION_SCHEMAS`` and ``register_configs``). Every name is re-exported here:
``from accel_train.config.schema import DdpConfig``.
"""

from __future__ import annotations

from accel_train.config.schema import submitit as _submitit
from accel_train.config.schema.catalogue import OPTION_SCHEMAS, register_configs, schema_name
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
    DATASET_COMMON_KEYS,
    DATASET_RECIPE_KEYS,
    AudioFolderDatasetConfig,
    DatasetConfig,
    ImageFolderDatasetConfig,
    MaskFolderDatasetConfig,
    PreferenceDatasetConfig,
    PromptsDatasetConfig,
    RecipeDatasetConfig,
    SftDatasetConfig,
    SignalArraysDatasetConfig,
    SignalFeaturesConfig,
    SignalKeysConfig,
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
from accel_train.config.schema.logger import (
    LOGGER_SCHEMAS,
    CsvLoggerConfig,
    MlflowLoggerConfig,
    TensorboardLoggerConfig,
    WandbLoggerConfig,
)
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
from accel_train.config.schema.optimizer import AdamConfig, MuonConfig, OptimizerConfig, SgdConfig
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
    PruneScheduleConfig,
    QatConfig,
    QuantConfig,
    SelectiveBackpropConfig,
)
from accel_train.config.schema.train import TrainConfig
from accel_train.config.schema.trainer import (
    EarlyStoppingConfig,
    HarnessConfig,
    ProgressiveResizeConfig,
    TrainerConfig,
)

if _submitit.SubmititSlurmConfig is not None:  # the `slurm` extra installed
    SubmititSlurmConfig = _submitit.SubmititSlurmConfig

__all__ = [
    "ModelConfig",
    "MnistCnnConfig",
    "SmallCnnConfig",
    "VideoCnnConfig",
    "Resnet1dConfig",
    "SpecCnnConfig",
    "MlpConfig",
    "Resnet18Config",
    "GptConfig",
    "HfModelConfig",
    "TimmModelConfig",
    "MonaiModelConfig",
    "SmpModelConfig",
    "TorchvisionModelConfig",
    "DATASET_COMMON_KEYS",
    "DatasetConfig",
    "TorchvisionDatasetConfig",
    "SyntheticDatasetConfig",
    "TokensDatasetConfig",
    "SftDatasetConfig",
    "PreferenceDatasetConfig",
    "PromptsDatasetConfig",
    "RecipeDatasetConfig",
    "DATASET_RECIPE_KEYS",
    "ImageFolderDatasetConfig",
    "VideoFolderDatasetConfig",
    "VolumeFolderDatasetConfig",
    "MaskFolderDatasetConfig",
    "SignalArraysDatasetConfig",
    "AudioFolderDatasetConfig",
    "SignalFeaturesConfig",
    "SignalKeysConfig",
    "StreamingVideoDatasetConfig",
    "StreamingDatasetConfig",
    "StreamingSftDatasetConfig",
    "StreamingPreferenceDatasetConfig",
    "StreamingTokensDatasetConfig",
    "LossConfig",
    "CrossEntropyConfig",
    "TaskConfig",
    "ClassificationTaskConfig",
    "RegressionTaskConfig",
    "SegmentationTaskConfig",
    "LanguageModelTaskConfig",
    "PreferenceTaskConfig",
    "GrpoTaskConfig",
    "CustomTaskConfig",
    "PrecisionConfig",
    "StrategyConfig",
    "DdpConfig",
    "FsdpConfig",
    "TpConfig",
    "PipelineConfig",
    "LauncherConfig",
    "SlurmLauncherConfig",
    "RayLauncherConfig",
    "KubernetesLauncherConfig",
    "LoaderConfig",
    "TorchLoaderConfig",
    "RayLoaderConfig",
    "OptimizerConfig",
    "SgdConfig",
    "AdamConfig",
    "MuonConfig",
    "SchedulerConfig",
    "StepSchedulerConfig",
    "CosineSchedulerConfig",
    "OneCycleSchedulerConfig",
    "ProgressiveResizeConfig",
    "HarnessConfig",
    "TrainerConfig",
    "EarlyStoppingConfig",
    "QuantConfig",
    "QatConfig",
    "DistillConfig",
    "PruneScheduleConfig",
    "PruneConfig",
    "SelectiveBackpropConfig",
    "EmaConfig",
    "LoraConfig",
    "ActivationCheckpointingConfig",
    "CheckpointConfig",
    "CsvLoggerConfig",
    "TensorboardLoggerConfig",
    "MlflowLoggerConfig",
    "WandbLoggerConfig",
    "LOGGER_SCHEMAS",
    "PathsConfig",
    "TrainConfig",
    "EvalConfig",
    "ExportConfig",
    "SampleConfig",
    "TokenizeConfig",
    "ConvertConfig",
    "ShardConfig",
    "OPTION_SCHEMAS",
    "schema_name",
    "register_configs",
]
