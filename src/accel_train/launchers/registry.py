"""The launchers by name: `launcher=<name>` picks the class registered as that name
(`@register_launcher(name, Config)`, accel_train/plugins.py), imported when a run asks for it.

The built-in ones are a module each, named in names.py; a run imports the one it uses (local:
none of Ray's, SLURM's or Kubernetes' code), and an installed package's launcher comes in
through the `accel_train.plugins` entry points. (The run dir's lock and the torch-free
preflight ask names.py, which imports no launcher.)"""

from __future__ import annotations

from omegaconf import DictConfig

from accel_train.launchers.base import Launcher
from accel_train.launchers.names import unknown_launcher
from accel_train.plugins import CLASSES, class_for

# The launcher classes registered so far, by name (the built-in ones once imported; their names
# and modules: launchers/names.py).
LAUNCHERS: dict[str, type[Launcher]] = CLASSES["launcher"]


def launcher_for(cfg: DictConfig) -> Launcher:
    """The launcher `cfg.launcher.name` names."""
    name = cfg.launcher.name
    cls = class_for("launcher", name)
    if cls is None:
        raise unknown_launcher(name)
    return cls()
