"""model: a class or factory by `_target_`; the data shape is passed where accepted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


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
class Resnet1dConfig(ModelConfig):
    # models/signals.py (issue 64): a 1-D ResNet on raw windows.
    width: int = 32
    depth: int = 1
    dropout: float = 0.0


@dataclass
class SpecCnnConfig(ModelConfig):
    # models/signals.py (issue 64): a small 2-D CNN on spectrograms.
    width: int = 32
    dropout: float = 0.2


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
class MonaiModelConfig(ModelConfig):
    _target_: str = "accel_train.models.monai.monai_model"
    name: str = MISSING
    args: dict[str, Any] = field(default_factory=dict)  # the network's own arguments


@dataclass
class SmpModelConfig(ModelConfig):
    _target_: str = "accel_train.models.smp.smp_model"
    name: str = MISSING
    encoder: str = "resnet34"


@dataclass
class TorchvisionModelConfig(ModelConfig):
    _target_: str = "accel_train.models.torchvision.torchvision_model"
    name: str = MISSING
