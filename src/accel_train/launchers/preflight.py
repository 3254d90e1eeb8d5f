"""`accel-train`'s refusals that need no torch, before anything imports it: cli.py runs
`preflight` on the composed config, then imports launch.py (and torch, 2-3 CPU s) only for a
config that passed. A refused config then costs well under a CPU second (BENCHMARKS.md
section 38).

It refuses what launch.launch would refuse first, in the same words: an unknown launcher, then
the config checks (config/checks.validate) and resolving. launch.py runs two steps before those
that may change the config and need torch: the default strategy for a run of several processes
(its world size asks the GPUs) and a model source's launch-time step (models/__init__:
prepare_model_config, e.g. timm's name read from its weights folder). Where either could change
something, the preflight checks nothing more and launch.py decides as before; where neither can,
the checks run on a copy of the config, and launch.py runs them again on the real one.
"""

from __future__ import annotations

import copy

from omegaconf import DictConfig, OmegaConf

from accel_train.config.checks import validate
from accel_train.config.run_config import group_chosen, resolve
from accel_train.environment import in_srun_step, inside_torchrun
from accel_train.launchers.names import known_launcher, unknown_launcher

# Our model builders with no launch-time step (no `prepare_config`): a config naming one is
# checked here. Any other `accel_train.models.` target is left to launch.py (tests/
# test_architecture.py checks this list against configs/model/).
PLAIN_MODELS = (
    "accel_train.models.gpt.GPT",
    "accel_train.models.mlp",
    "accel_train.models.mnist_cnn",
    "accel_train.models.resnet18",
    "accel_train.models.small_cnn",
    "accel_train.models.video_cnn.video_cnn",
    "accel_train.models.signals.resnet1d",
    "accel_train.models.signals.spec_cnn",
)
OUR_MODELS = "accel_train.models."


def preflight(cfg: DictConfig) -> None:
    """Raises the UserError (or config error) launch.launch would raise first, where it is one
    of the launcher's name, the config checks or resolving and no torch is needed to tell;
    returns quietly otherwise. `cfg` is left as it was."""
    name = cfg.launcher.name
    if not known_launcher(name):
        raise unknown_launcher(name)
    if not _checked_as_composed(cfg):
        return
    cfg = copy.deepcopy(cfg)
    validate(cfg)
    resolve(cfg)


def _checked_as_composed(cfg: DictConfig) -> bool:
    """Whether launch.py checks the config as composed: no default strategy is chosen for
    several processes, and the model has no launch-time step."""
    if not OmegaConf.is_missing(cfg.model, "_target_"):
        target = str(cfg.model.get("_target_") or "")
        if target.startswith(OUR_MODELS) and target not in PLAIN_MODELS:
            return False
    if group_chosen("strategy"):
        return True
    # launch.choose_default_strategy asks the launcher for its world size: one process on
    # this node (no GPU count needed; trainer.device=cuda asks torch for the device first).
    lc = cfg.launcher
    return (
        lc.name in ("local", "torchrun")
        and not inside_torchrun()
        and not in_srun_step()
        and str(lc.nnodes) == "1"
        and str(lc.nproc_per_node) == "1"
        and cfg.trainer.device != "cuda"
    )
