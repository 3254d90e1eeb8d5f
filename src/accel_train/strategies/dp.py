"""strategy=dp: torch.nn.DataParallel, refused at compose (config/combinations.py says why).
The class exists so that the option composes and its refusal is the one the user reads."""

from __future__ import annotations

from accel_train.config.schema import StrategyConfig
from accel_train.plugins import register_strategy
from accel_train.strategies.base import Strategy


@register_strategy("dp", StrategyConfig)
class DataParallel(Strategy):
    name = "dp"
