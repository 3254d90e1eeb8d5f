"""A strategy as a third-party package adds one (docs/architecture.md): this file, registered by
its decorator, and an `accel_train.plugins` entry point naming it (tests/test_toy_extensions.py
installs both in a package of its own). One process, the model trained as it is; it counts the
optimizer steps the loop asked it about, in a file of the run dir, so the test sees the loop
used it. Its option has a key of its own, typed by its dataclass; no YAML."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_train.config.schema import StrategyConfig
from accel_train.plugins import register_strategy
from accel_train.strategies.base import Strategy, Wrapped

MARKER = "steps_seen_by_toy_strategy.txt"


@dataclass
class ToyStrategyConfig(StrategyConfig):
    marker: str = MARKER  # the file of the run dir the step count goes to


@register_strategy("toy", ToyStrategyConfig)
class ToyStrategy(Strategy):
    name = "toy"

    def wrap(self, module: Any, env: Any, sample: Any, precision: Any) -> Wrapped:
        self.steps = 0
        return Wrapped(module, module, module)

    def before_optimizer_step(self) -> None:
        self.steps += 1
        marker = Path(self.run_cfg.paths.output_dir) / self.run_cfg.strategy.marker
        marker.write_text(f"{self.steps}\n")
