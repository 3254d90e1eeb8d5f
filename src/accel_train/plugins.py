"""The plugin points: a strategy, a launcher or a task is a class and its config dataclass,
registered with one decorator, inside accel-train or in a package of the user's own::

    from accel_train.plugins import register_strategy

    @dataclass
    class MineConfig(StrategyConfig):   # accel_train.config.schema.StrategyConfig
        buckets: int = 4                # the option's own keys, typed, with their defaults

    @register_strategy("mine", MineConfig)
    class Mine(Strategy): ...

`strategy=mine` then exists: the option is stored in Hydra's ConfigStore (no YAML, no edit to
config/schema/), typed by its dataclass (a misspelled key fails when Hydra composes), and
`accel-train --help` lists it. The built-in options register the same way, beside their
commented YAML (configs/<group>/<name>.yaml, which then holds the defaults).

A package registers without editing accel-train through the entry-point group
`accel_train.plugins` (as pytest's and Hydra's plugins do): every module it names is imported
when a command starts, before Hydra composes, and its decorators run. Such a module should import
its heavy dependencies where it uses them (inside `wrap` or `launch`), as the built-in ones do:
it is imported by every command, `--help` included. An exception while importing it is reported
as that exception, with the plugin's file and line.

Imports no torch: the CLI loads it before Hydra composes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from accel_train.config import CONFIG_DIR
from accel_train.config.lazy_store import store_lazily
from accel_train.config.schema import (
    OPTION_SCHEMAS,
    LauncherConfig,
    StrategyConfig,
    TaskConfig,
    schema_name,
)
from accel_train.errors import UserError

ENTRY_POINT_GROUP = "accel_train.plugins"

# group -> the config dataclass every option of it must extend (its shared keys).
BASES: dict[str, type] = {
    "strategy": StrategyConfig,
    "launcher": LauncherConfig,
    "task": TaskConfig,
}

# group -> option name -> the registered class (tasks are built by `_target_` instead).
CLASSES: dict[str, dict[str, type]] = {group: {} for group in BASES}
# option name -> the module that registers it, for built-in options imported when first asked
# for (a run imports the launcher it uses, not the other four): filled by the groups' packages.
BUILTIN_MODULES: dict[str, dict[str, str]] = {group: {} for group in BASES}

T = TypeVar("T", bound=type)


def register(group: str, name: str, config: type | None = None) -> Callable[[T], T]:
    """The decorator behind `register_strategy`, `register_launcher` and `register_task`:
    `config` (a dataclass extending the group's base, `BASES`; the base itself when None) types
    the option `group=name`, which Hydra composes with no YAML."""
    base = BASES[group]
    config = config or base
    typed = isinstance(config, type) and dataclasses.is_dataclass(config)
    if not (typed and issubclass(config, base)):
        raise UserError(
            f"register_{group}({name!r}, {getattr(config, '__name__', config)!r}): the config "
            f"must be a dataclass extending accel_train.config.schema.{base.__name__} (its "
            f"shared keys), e.g. `@dataclass class MyConfig({base.__name__}): ...`."
        )

    def decorate(cls: T) -> T:
        known = CLASSES[group].get(name)
        if known is not None and _qualname(known) != _qualname(cls):
            raise UserError(
                f"{group}={name} is registered twice: by {_qualname(known)} and by "
                f"{_qualname(cls)}. Give one of them another name."
            )
        CLASSES[group][name] = cls
        _store(group, name, config, cls)
        return cls

    return decorate


def register_strategy(name: str, config: type | None = None) -> Callable[[T], T]:
    """`@register_strategy("mine", MineConfig)` on a `Strategy` subclass: `strategy=mine`."""
    return register("strategy", name, config)


def register_launcher(name: str, config: type | None = None) -> Callable[[T], T]:
    """`@register_launcher("mine", MineConfig)` on a `Launcher` subclass: `launcher=mine`."""
    return register("launcher", name, config)


def register_task(name: str, config: type | None = None) -> Callable[[T], T]:
    """`@register_task("mine", MineConfig)` on a `Task` subclass: `task=mine` builds it (its
    `_target_`) with the option's keys."""
    return register("task", name, config)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _store(group: str, name: str, config: type, cls: type) -> None:
    """The option's typed schema, and the option itself unless a YAML of the package holds it
    (a built-in option's commented defaults win; the schema types both)."""
    OPTION_SCHEMAS.setdefault(group, {})[name] = config
    store_lazily(schema_name(config), config, group)
    if (CONFIG_DIR / group / f"{name}.yaml").is_file():
        return
    node: dict[str, Any] = {"name": name}
    if group == "task":
        node["_target_"] = _qualname(cls)
    store_lazily(name, config(**node), group)


def class_for(group: str, name: str) -> type | None:
    """The class registered as `group=name`: a built-in imported on first use, then the
    installed plugins; None when nobody registers that name."""
    if name not in CLASSES[group] and name in BUILTIN_MODULES[group]:
        importlib.import_module(BUILTIN_MODULES[group][name])
    if name not in CLASSES[group]:
        load_plugins()
    return CLASSES[group].get(name)


def names(group: str) -> list[str]:
    """Every option name `group=` takes: the built-in ones and the plugins'."""
    load_plugins()
    return sorted({*BUILTIN_MODULES[group], *CLASSES[group], *OPTION_SCHEMAS.get(group, {})})


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
