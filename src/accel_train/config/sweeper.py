"""The `hydra/sweeper=optuna` config node: the settings of accel-train's Optuna sweeper
(hydra_plugins/accel_train_optuna, which imports this). Hydra validates `hydra.sweeper.*`
against it when composing.

It is stored twice: by the plugin's `config` module when Hydra's plugin scan imports it (as
every Hydra plugin stores its node), and again by accel_train.config.schema.register_configs
after the scan, so that it wins over the node of an old hydra-optuna-sweeper installed beside
it (the scan runs that plugin's config module after ours, storing its node over ours)."""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

SWEEPER = "hydra_plugins.accel_train_optuna.optuna_sweeper.OptunaSweeper"


@dataclass
class OptunaSweeperConf:
    # the sweeper class (Hydra instantiates sweepers only from the hydra_plugins package)
    _target_: str = SWEEPER
    # hand `sampler` and `pruner` over as configs: the sweeper builds them, so a wrong
    # `_target_` is an error naming the key instead of Hydra's instantiation traceback
    _recursive_: bool = False
    # Optuna's sampler by `_target_` (TPESampler, RandomSampler, GridSampler, CmaEsSampler,
    # NSGAIISampler, ... in optuna.samplers) and its arguments, e.g. `seed`
    sampler: Any = field(
        default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": None}
    )
    # minimize or maximize, or a list with one per objective; null: each objective's own
    # direction (maximize accuracies and throughput, minimize loss, time and steps)
    direction: Any = None
    # the summary.json metrics a trial returns; null: the run's `objective` (one value)
    objectives: Any = None
    # the study's name in `storage`; null: the run's `name`, so a rerun finds the same study
    study_name: Any = None
    # null: in memory; a database URL (sqlite:///optuna.db) keeps the study and resumes it
    storage: Any = None
    # trials the study holds when the search ends (complete or pruned ones, earlier runs' too)
    n_trials: int = 20
    # trials asked for and launched together in a batch (in parallel with a parallel launcher)
    n_jobs: int = 1
    # stop the search once more than this share of its trials failed (1.0: never stop early)
    max_failure_rate: float = 1.0
    # the search space: key -> choice(...), range(...), interval(...), tag(log, interval(...)),
    # int(interval(...)), or a plain value every trial gets
    params: Any = None
    # optional `module.function(cfg, trial) -> {key: value}` adding conditional parameters
    custom_search_space: Any = None
    # Optuna's pruner by `_target_` (e.g. optuna.pruners.MedianPruner); null: no pruning
    pruner: Any = None
    # the validation metric a trial reports after each epoch for the pruner; null: val/loss
    # for objective=final_val_loss, val/acc otherwise
    pruning_metric: Any = None
    # hydra-optuna-sweeper's deprecated spelling of `params`: refused with what to rename
    search_space: Any = None


def register_optuna_sweeper() -> None:
    ConfigStore.instance().store(
        group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="accel_train"
    )
