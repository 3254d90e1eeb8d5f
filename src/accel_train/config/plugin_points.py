"""What config/ knows of the plugin points (accel_train/plugins.py, a layer above it): the
groups a plugin may add options to, with the dataclass each option's schema extends (`BASES`), and
the scan that imports the installed plugins (`load_plugins`: the entry-point group
`accel_train.plugins`). Their decorators (accel_train.plugins.register_*) then register into
config's stores: `OPTION_SCHEMAS` and Hydra's ConfigStore. config/run_config.py calls
`load_plugins` when a worker's config names an option nobody registered yet.

Imports no torch: the CLI loads it before Hydra composes.
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from pathlib import Path
from typing import Any

from accel_train.config.schema import LauncherConfig, StrategyConfig, TaskConfig
from accel_train.errors import UserError

ENTRY_POINT_GROUP = "accel_train.plugins"

# group -> the config dataclass every option of it must extend (its shared keys).
BASES: dict[str, type] = {
    "strategy": StrategyConfig,
    "launcher": LauncherConfig,
    "task": TaskConfig,
}

# ---- discovery: the entry-point group ------------------------------------------------------

_loaded = False


def load_plugins() -> None:
    """Import every module the installed packages name in the `accel_train.plugins` entry-point
    group (once a process): their decorators register their options."""
    global _loaded
    if _loaded or os.environ.get("ACCEL_TRAIN_NO_PLUGINS") == "1":
        return
    _loaded = True
    from importlib.metadata import entry_points  # ~10 ms: only where a command starts

    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as err:  # the plugin's own bug: its error, its file and line
            raise UserError(_plugin_failed(entry, err)) from err


def _plugin_failed(entry: Any, err: BaseException) -> str:
    dist = getattr(entry, "dist", None)
    package = f"{dist.name} {dist.version}" if dist is not None else "an installed package"
    where = _where(entry.value, err)
    return (
        f"the plugin {entry.name!r} ({package}, entry point `{entry.value}` in the group "
        f"{ENTRY_POINT_GROUP}) failed to import: {type(err).__name__}: {err}{where}. Fix the "
        f"plugin, or uninstall it (`pip uninstall {dist.name if dist else '<package>'}`), or set "
        "ACCEL_TRAIN_NO_PLUGINS=1 to start without plugins."
    )


def _where(value: str, err: BaseException) -> str:
    """`, at FILE line N: CODE` for the deepest frame of the failure inside the plugin's own
    package (a SyntaxError: its own file and line), else the deepest frame of all."""
    if isinstance(err, SyntaxError) and err.filename:
        return f", at {err.filename} line {err.lineno}"
    frames = traceback.extract_tb(err.__traceback__)
    top = value.split(":")[0].split(".")[0]
    spec = importlib.util.find_spec(top)
    root = None
    if spec is not None and spec.origin not in (None, "namespace"):
        root = Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin)
    own = [f for f in frames if root is not None and Path(f.filename).is_relative_to(root)]
    real = [f for f in frames if not f.filename.startswith("<frozen")]
    frame = (own or real or [None])[-1]
    if frame is None:
        return ""
    code = f": `{frame.line.strip()}`" if frame.line else ""
    return f", at {frame.filename} line {frame.lineno}{code}"
