"""Console entry points `accel-train` and `accel-eval`: Hydra composes, errors are reported as
one paragraph (accel_train.errors).

Start-up speed: this module imports no torch. The launch and training packages (and torch,
3-4 s to import here) are imported inside the Hydra task functions, after Hydra has composed
the config, so a misspelled override fails in well under a second. These deferred imports go
downward only (cli -> launch -> train); tests/test_architecture.py checks that nothing imports
cli.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from accel_train.config import CONFIG_DIR
from accel_train.config.schema import register_configs
from accel_train.environment import register_resolvers
from accel_train.errors import report_user_errors
from accel_train.launch import sweep_summary


def _check_config_dir() -> None:
    if not (CONFIG_DIR / "train.yaml").is_file():
        print(
            f"accel-train: error: the config directory {CONFIG_DIR} is missing. accel-train reads "
            "its YAML configs from the source checkout: install it with `pip install -e .`.",
            file=sys.stderr,
        )
        sys.exit(2)


register_configs()
register_resolvers()


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _train(cfg: DictConfig):
    if sweep_summary.in_multirun():
        from accel_train.launch.sweep import run_job  # deferred: see the module docstring

        # A sweep job: a failure is recorded in <job dir>/status.json and the sweep goes on.
        return run_job(cfg)
    return _train_single(cfg)


@report_user_errors
def _train_single(cfg: DictConfig):
    from accel_train.launch.launcher import launch  # deferred: see the module docstring

    return launch(cfg)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="eval")
@report_user_errors
def _evaluate(cfg: DictConfig):
    from accel_train.train.evaluate import evaluate_checkpoint  # deferred: see the docstring

    evaluate_checkpoint(cfg)


def train() -> None:
    _check_config_dir()
    report_user_errors(sweep_summary.check_plugins)(sys.argv[1:])
    try:
        _train()
    except KeyboardInterrupt:
        # Ctrl-C outside the training loop (start-up, the test pass), where nothing is left to
        # save: one line and 130, as the loop's own stop exits (train/signals.py).
        print("accel-train: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        sweep_summary.finish_pending()  # the sweeper raised: still write the jobs' summary
    result = sweep_summary.last_result
    if result is not None and result.failed:
        print(
            f"accel-train: {len(result.failed)} of {len(result.rows)} sweep jobs failed "
            f"(see {result.sweep_dir / sweep_summary.SUMMARY_NAME}.csv).",
            file=sys.stderr,
        )
        sys.exit(1)


def evaluate() -> None:
    _check_config_dir()
    _evaluate()
