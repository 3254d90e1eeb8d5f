"""A strategy as a developer adds one (docs/architecture.md): this file, one registry line
(`STRATEGIES["toy"] = ToyStrategy`, which tests/test_toy_extensions.py runs before the CLI) and
its option, strategy/toy.yaml. One process, the model trained as it is; it counts the optimizer
steps the loop asked it about, in a file of the run dir, so the test sees the loop used it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from accel_train.parallel import DistEnv
from accel_train.precision import Precision
from accel_train.strategies.base import Strategy, Wrapped

MARKER = "steps_seen_by_toy_strategy.txt"

# The option's file, for a config folder on Hydra's search path.
OPTION_YAML = """\
defaults:
  - strategy_schema
  - _self_
name: toy
backend: auto
"""


class ToyStrategy(Strategy):
    name = "toy"

    def wrap(self, module: nn.Module, env: DistEnv, sample: Any, precision: Precision) -> Wrapped:
        self.steps = 0
        return Wrapped(module, module, module)

    def before_optimizer_step(self) -> None:
        self.steps += 1
        marker = Path(self.run_cfg.paths.output_dir) / MARKER
        marker.write_text(f"{self.steps}\n")
