"""logger: the metric loggers.

Each option sits under its own key (`logger.csv`, `logger.mlflow`, ...), as in
lightning-hydra-template, so that several chosen at once (`logger=[csv,mlflow]`) do not
overwrite each other; `cfg.logger` maps each chosen logger to its settings."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING


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
