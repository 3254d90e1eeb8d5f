"""The launchers by name: `launcher=<name>` picks the class registered as that name
(`@register_launcher(name, Config)`, accel_train/plugins.py), imported when a run asks for it.

The built-in ones are a module each, named below; a run imports the one it uses (local: none of
Ray's, SLURM's or Kubernetes' code), and an installed package's launcher comes in through the
`accel_train.plugins` entry points. Defined below the launcher modules, because the run dir's
lock (`lock.role`, which the launchers' workers import) asks it too.
"""

from __future__ import annotations

from omegaconf import DictConfig

from accel_train.errors import UserError
from accel_train.launchers.base import Launcher
from accel_train.plugins import BUILTIN_MODULES, CLASSES, class_for, names

# The built-in launchers: name -> the module whose `@register_launcher` registers it.
BUILTIN_MODULES["launcher"].update(
    local="accel_train.launchers.local",
    torchrun="accel_train.launchers.torchrun",
    slurm="accel_train.launchers.slurm",
    ray="accel_train.launchers.ray",
    kubernetes="accel_train.launchers.kubernetes",
)

# The launcher classes registered so far, by name (the built-in ones once imported).
LAUNCHERS: dict[str, type[Launcher]] = CLASSES["launcher"]


def launcher_for(cfg: DictConfig) -> Launcher:
    """The launcher `cfg.launcher.name` names."""
    name = cfg.launcher.name
    cls = class_for("launcher", name)
    if cls is None:
        raise UserError(
            f"launcher={name} is not a launcher accel-train knows ({', '.join(names('launcher'))}):"
            " choose one of them, or register yours with `@register_launcher(name, Config)` "
            "(accel_train.plugins; docs/architecture.md)."
        )
    return cls()
