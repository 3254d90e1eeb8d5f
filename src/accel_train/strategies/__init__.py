"""Parallelism strategies: one small class per strategy (base.py says what a strategy answers),
chosen by `strategy.name` from the classes registered with `@register_strategy(name, Config)`
(accel_train.plugins). To add one: a file here with a `Strategy` subclass under that decorator
and its import line below (or, outside accel-train, an `accel_train.plugins` entry point;
docs/architecture.md)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from accel_train.config import CONFIG_DIR
from accel_train.config.schema import OPTION_SCHEMAS
from accel_train.plugins import CLASSES, class_for, names
from accel_train.strategies.base import Strategy, WorldKeys, Wrapped, refuse_unknown
from accel_train.strategies.ddp import DDP
from accel_train.strategies.dp import DataParallel
from accel_train.strategies.fsdp import FSDP
from accel_train.strategies.pipeline import PipelineParallel
from accel_train.strategies.single import Single
from accel_train.strategies.tp import TensorParallel

__all__ = [
    "STRATEGIES",
    "Strategy",
    "WorldKeys",
    "Wrapped",
    "default_for_world",
    "strategy_class",
    "strategy_for",
]

# The strategies by name: the built-in ones (imported above, each registering itself) and the
# installed plugins' (accel_train.plugins.load_plugins, on the first name not found here).
STRATEGIES: dict[str, type[Strategy]] = CLASSES["strategy"]
# The built-in strategies, registered by their own decorators when imported above.
BUILTIN = (Single, DataParallel, DDP, FSDP, TensorParallel, PipelineParallel)


def strategy_class(name: str) -> type[Strategy]:
    """The class registered under `name` (e.g. a checkpoint's strategy, for what it holds)."""
    cls = class_for("strategy", name)
    if cls is None:
        raise refuse_unknown(name, names("strategy"))
    return cls


def strategy_for(cfg: DictConfig) -> Strategy:
    """A fresh strategy object for the run's config (one per process: it holds the pipeline's
    stage once `wrap` has cut the model)."""
    return strategy_class(cfg.strategy.name)(cfg)


# What several processes train with when the user named no strategy: DDP, as a torchrun script
# does and as Lightning's strategy="auto" chooses for several devices.
MULTI_PROCESS_DEFAULT = "ddp"


def default_for_world(cfg: DictConfig, world: int | None) -> str | None:
    """The user named no strategy (train.yaml's one-process default holds) and the launch
    plans `world` processes: with more than one, cfg.strategy becomes the DDP option (its own
    YAML, strategy.backend kept). Returns the line that says so; None when nothing changed."""
    if world is None or world < 2:
        return None
    name = MULTI_PROCESS_DEFAULT
    option = OmegaConf.load(CONFIG_DIR / "strategy" / f"{name}.yaml")
    option.pop("defaults", None)
    schema = OmegaConf.structured(OPTION_SCHEMAS["strategy"][name])
    cfg.strategy = OmegaConf.merge(schema, option, {"backend": cfg.strategy.backend})
    return (
        f"no strategy named and {world} processes: training with strategy={name} "
        "(DistributedDataParallel, as torchrun and Lightning do); name another to choose it, "
        "e.g. `strategy=fsdp`"
    )
