"""Parallelism strategies: one small class per strategy (base.py says what a strategy answers),
chosen by `strategy.name` from the one registry below. To add one: a file here with a
`Strategy` subclass, its line in STRATEGIES, and its option in configs/strategy/
(docs/architecture.md)."""

from __future__ import annotations

from omegaconf import DictConfig

from accel_train.strategies.base import Strategy, Wrapped, refuse_unknown
from accel_train.strategies.ddp import DDP
from accel_train.strategies.dp import DataParallel
from accel_train.strategies.fsdp import FSDP
from accel_train.strategies.pipeline import PipelineParallel
from accel_train.strategies.single import Single
from accel_train.strategies.tp import TensorParallel

__all__ = ["STRATEGIES", "Strategy", "Wrapped", "strategy_class", "strategy_for"]

STRATEGIES: dict[str, type[Strategy]] = {
    "single": Single,
    "dp": DataParallel,
    "ddp": DDP,
    "fsdp": FSDP,
    "tp": TensorParallel,
    "pipeline": PipelineParallel,
}


def strategy_class(name: str) -> type[Strategy]:
    """The class registered under `name` (e.g. a checkpoint's strategy, for what it holds)."""
    if name not in STRATEGIES:
        raise refuse_unknown(name, sorted(STRATEGIES))
    return STRATEGIES[name]


def strategy_for(cfg: DictConfig) -> Strategy:
    """A fresh strategy object for the run's config (one per process: it holds the pipeline's
    stage once `wrap` has cut the model)."""
    return strategy_class(cfg.strategy.name)(cfg)
