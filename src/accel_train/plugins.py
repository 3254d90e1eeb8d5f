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

The groups a plugin may add to (`BASES`) and the entry-point scan (`load_plugins`) live in
accel_train.config.plugin_points, below this module: config types a worker's config by a
plugin's schema without importing the decorators; they register into config's
`OPTION_SCHEMAS` and Hydra's ConfigStore.

Imports no torch: the CLI loads it before Hydra composes.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from accel_train.config import CONFIG_DIR
from accel_train.config.lazy_store import store_lazily
from accel_train.config.plugin_points import BASES, load_plugins
from accel_train.config.schema import OPTION_SCHEMAS, schema_name
from accel_train.errors import UserError

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
