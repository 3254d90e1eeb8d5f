"""The `hydra/sweeper=optuna` config node, stored when Hydra's plugin scan imports this module
(its schema, OptunaSweeperConf, is accel_train.config.sweeper's: accel-train stores it again
after the scan, over an old hydra-optuna-sweeper's node), and the callback that runs configs
written for that old plugin with this one."""

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from accel_train.config.sweeper import SWEEPER, register_optuna_sweeper

# What hparams_search files written for hydra-optuna-sweeper name (it pins optuna<3).
OLD_SWEEPER = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


class AdoptOldSweeper(Callback):
    """A Hydra callback (configs/hydra/default.yaml): a config that still names
    hydra-optuna-sweeper's class runs this sweeper, the same keys, unchanged. It runs before
    Hydra instantiates the sweeper."""

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        if OmegaConf.select(config, "hydra.sweeper._target_") == OLD_SWEEPER:
            with read_write(config.hydra.sweeper), open_dict(config.hydra.sweeper):
                config.hydra.sweeper._target_ = SWEEPER


register_optuna_sweeper()
