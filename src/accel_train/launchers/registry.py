"""The launchers by name: `launcher=<name>` picks `LAUNCHERS[name]`.

The dict is filled in `launchers/__init__.py`, one line per launcher. It is defined here, below
the launcher modules, because the run dir's lock (`lock.role`, which the launchers' workers
import) asks it too: defined in the package's `__init__`, which imports every launcher, it
would close an import cycle. Any import of a `launchers` module runs `__init__` first, so the
dict is full by the time anyone looks a name up.
"""

from __future__ import annotations

from omegaconf import DictConfig

from accel_train.errors import UserError
from accel_train.launchers.base import Launcher

LAUNCHERS: dict[str, type[Launcher]] = {}


def launcher_for(cfg: DictConfig) -> Launcher:
    """The launcher `cfg.launcher.name` names."""
    name = cfg.launcher.name
    if name not in LAUNCHERS:
        known = ", ".join(sorted(LAUNCHERS))
        raise UserError(
            f"launcher={name} is not a launcher accel-train knows ({known}): "
            f"choose one of them, or register yours with `LAUNCHERS[{name!r}] = YourLauncher` "
            "(accel_train.launchers) before the run starts (docs/architecture.md)."
        )
    return LAUNCHERS[name]()
