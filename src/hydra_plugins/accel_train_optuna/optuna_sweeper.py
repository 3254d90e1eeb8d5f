"""`hydra/sweeper=optuna`: the Hydra Sweeper class. Light on purpose (Hydra imports this module
at every start-up); the search is in `_study`, imported when a sweep starts."""

from __future__ import annotations

from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class OptunaSweeper(Sweeper):
    """Optuna's ask/tell loop over Hydra jobs: see hydra_plugins/accel_train_optuna."""

    def __init__(self, **settings: Any) -> None:
        # The keys of accel_train.config.sweeper.OptunaSweeperConf, validated by Hydra against it.
        self.settings = settings
        self.config: DictConfig | None = None
        self.launcher = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: list[str]) -> Any:
        # A UserError goes up to the CLI's reporter (config/hydra_errors.py): one paragraph,
        # after the sweep summary when trials ran.
        from hydra_plugins.accel_train_optuna._study import run_search

        return run_search(self, arguments)
