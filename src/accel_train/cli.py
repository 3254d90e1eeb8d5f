"""Console entrypoints `accel-train` and `accel-eval`: Hydra composes, we report errors cleanly."""

from __future__ import annotations

import functools
import logging
import os
import sys

import hydra
from omegaconf import DictConfig

from accel_train.config import CONFIG_DIR, UserError, register_configs
from accel_train.environment import register_resolvers

log = logging.getLogger("accel_train")


def report_user_errors(fn):
    """A UserError becomes one paragraph on stderr and exit code 2 (the traceback only with
    HYDRA_FULL_ERROR=1, like Hydra's own errors)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            prog = os.path.basename(sys.argv[0]) or "accel-train"
            print(
                f"{prog}: error: {err}\n(Set HYDRA_FULL_ERROR=1 for the traceback.)",
                file=sys.stderr,
            )
            sys.exit(2)

    return wrapper


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
    from accel_train import sweep

    if sweep.in_multirun():
        # A sweep job: a failure is recorded in <job dir>/status.json and the sweep goes on.
        return sweep.run_job(cfg)
    return _train_single(cfg)


@report_user_errors
def _train_single(cfg: DictConfig):
    from accel_train.launch import launch

    return launch(cfg)


@report_user_errors
def _check_plugins(argv: list[str]) -> None:
    from accel_train.sweep import check_plugins

    check_plugins(argv)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="eval")
@report_user_errors
def _evaluate(cfg: DictConfig):
    from accel_train.evaluate import evaluate_checkpoint

    evaluate_checkpoint(cfg)


def train() -> None:
    from accel_train import sweep

    _check_config_dir()
    _check_plugins(sys.argv[1:])
    try:
        _train()
    finally:
        sweep.finish_pending()  # the sweeper raised: still write the summary of the jobs run
    result = sweep.last_result
    if result is not None and result.failed:
        print(
            f"accel-train: {len(result.failed)} of {len(result.rows)} sweep jobs failed "
            f"(see {result.sweep_dir / sweep.SUMMARY_NAME}.csv).",
            file=sys.stderr,
        )
        sys.exit(1)


def evaluate() -> None:
    _check_config_dir()
    _evaluate()
