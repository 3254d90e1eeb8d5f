"""The built-in launchers' names and the modules that register them, and the refusal of a name
nobody registers: what registry.py and the torch-free preflight (launchers/preflight.py) share.
Imports no launcher and no torch."""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig

from accel_train.errors import UserError
from accel_train.plugins import BUILTIN_MODULES, CLASSES, class_for, load_plugins, names

# The built-in launchers: name -> the module whose `@register_launcher` registers it.
BUILTIN_MODULES["launcher"].update(
    local="accel_train.launchers.local",
    torchrun="accel_train.launchers.torchrun",
    slurm="accel_train.launchers.slurm",
    ray="accel_train.launchers.ray",
    kubernetes="accel_train.launchers.kubernetes",
)

# A built-in launcher -> whether it hands the run to a scheduler and returns before it trains
# (`Launcher.submits_and_exits`), from its keys.
SUBMITTED: dict[str, Callable[[DictConfig], bool]] = {
    "local": lambda lc: False,
    "torchrun": lambda lc: False,
    "slurm": lambda lc: True,
    "kubernetes": lambda lc: True,
    "ray": lambda lc: lc.submit == "job",
}


def known_launcher(name: str) -> bool:
    """Whether `launcher=name` names a launcher (a built-in one or a plugin's), importing none."""
    if name in BUILTIN_MODULES["launcher"] or name in CLASSES["launcher"]:
        return True
    load_plugins()
    return name in CLASSES["launcher"]


def submits_and_exits(cfg: DictConfig) -> bool:
    """`Launcher.submits_and_exits` of the launcher `cfg.launcher.name` names, for the run dir's
    lock (launchers/lock.py), which asks at every start-up, before the config is checked: a
    built-in launcher's answer from its name and keys (the launcher classes answer the same,
    tests/test_architecture.py), a plugin's from its class."""
    name = cfg.launcher.name
    if name in SUBMITTED:
        return SUBMITTED[name](cfg.launcher)
    cls = class_for("launcher", name)
    if cls is None:
        raise unknown_launcher(name)
    return cls().submits_and_exits(cfg)


def unknown_launcher(name: str) -> UserError:
    return UserError(
        f"launcher={name} is not a launcher accel-train knows ({', '.join(names('launcher'))}):"
        " choose one of them, or register yours with `@register_launcher(name, Config)` "
        "(accel_train.plugins; docs/architecture.md)."
    )
