"""The run's config as a file: resolve once in the parent, write ``config.yaml``, load it in
workers (typed again against the schema), compare two configs key by key."""

from __future__ import annotations

import dataclasses
import io
import os
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.tree import Tree

from accel_train.config import CONFIG_DIR
from accel_train.config.moved import renamed
from accel_train.config.plugin_points import BASES, load_plugins
from accel_train.config.schema import LOGGER_SCHEMAS, OPTION_SCHEMAS, TrainConfig
from accel_train.errors import UserError


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python types (what checkpoints store)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    return container


# Groups whose options take the user's own constructor arguments (`+model.width=96`): their
# schema types the known keys and lets the others through.
OPEN_GROUPS = ("model", "dataset", "loss")


# The task of a config written before the `task` group (a checkpoint's, a run dir's).
DEFAULT_TASK = {
    "_target_": "accel_train.tasks.classification.Classification",
    "name": "classification",
    "monitor": "val/acc",
    "monitor_mode": "max",
    "objective": "best_val_acc",
    "top_k": [1],
}


def escape_interpolations(value: Any) -> Any:
    """A resolved tree with every literal `${` escaped again (`\\${`): a value the user escaped
    on the command line (`'launcher.setup=["source \\${HOME}/venv/bin/activate"]'`) resolved
    to a plain `${HOME}`, which OmegaConf would read as an interpolation once the tree is a
    config again. Escaped, it stays the user's literal text (in config.yaml too)."""
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, dict):
        return {k: escape_interpolations(v) for k, v in value.items()}
    if isinstance(value, list):
        return [escape_interpolations(v) for v in value]
    return value


def typed(tree: dict[str, Any], *, resolved: bool = True) -> DictConfig:
    """A resolved, plain config tree typed against the schema: each group by its option's
    dataclass, looked up by `name`. In the groups built by `_target_` (model, dataset, loss) an
    option of the user's own (their YAML with `_target_` and its arguments, no `name` and no
    schema in its defaults, as in lightning-hydra-template) is typed by the group's `custom`
    schema, so it gets that schema's defaults (dataset.val_fraction, ...). `resolved=False`:
    a tree whose interpolations are still to resolve (to check its keys and types only).
    A module path that has moved since the tree was written (a run dir's config.yaml, a
    checkpoint's config, an old override) is named as it is now (config/moved.py)."""
    tree = renamed(tree)
    if resolved:
        tree = escape_interpolations(tree)
    if "task" not in tree:  # written before tasks existed: every such run classified
        tree = {**tree, "task": dict(DEFAULT_TASK)}
    if any(_unregistered(tree.get(group), group) for group in BASES):
        load_plugins()  # a worker's config names a plugin's strategy (its schema registers)
    cfg = OmegaConf.structured(TrainConfig)
    for group, options in OPTION_SCHEMAS.items():
        node = tree.get(group)
        if not isinstance(node, dict):
            continue
        schema = _schema_by_target(options, node) or options.get(node.get("name"))
        if schema is None and group in OPEN_GROUPS:
            schema = options["custom"]
        elif schema is None and "name" not in node and list(options) == ["default"]:
            # A group with one option (trainer, ema, ...) and a config written before its
            # option recorded `name`, or a user's own option of it: typed by that option.
            schema = options["default"]
        if schema is not None:
            cfg[group] = OmegaConf.structured(schema)
            if group in OPEN_GROUPS or group == "task":  # (a task class's own arguments)
                OmegaConf.set_struct(cfg[group], False)
    loggers = tree.get("logger")
    for name in loggers if isinstance(loggers, dict) else ():
        if name in LOGGER_SCHEMAS:  # each chosen logger by its own schema
            cfg.logger[name] = OmegaConf.structured(LOGGER_SCHEMAS[name])
    merged = OmegaConf.merge(cfg, tree)
    assert isinstance(merged, DictConfig)
    return merged


def _unregistered(node: Any, group: str) -> bool:
    return isinstance(node, dict) and node.get("name") not in OPTION_SCHEMAS.get(group, {})


def _schema_by_target(options: dict[str, type], node: dict[str, Any]) -> type | None:
    """The schema whose `_target_` the node builds, looked up first: an option's `name` may be
    a value of its own (model=torchvision model.name=resnet18 is not model=resnet18's option)."""
    target = node.get("_target_")
    for schema in options.values() if target is not None else ():
        default = {f.name: f.default for f in dataclasses.fields(schema)}.get("_target_")
        if default == target:
            return schema
    return None


def resolve(cfg: DictConfig) -> DictConfig:
    """The composed config with every interpolation evaluated, typed against the schema.

    After this nothing refers to Hydra's runtime any more, so a worker can load the file."""
    return typed(to_container(cfg))


def command_line_keys() -> set[str]:
    """The keys the user set on the command line (`key=...`, `+key=...`, `~key`); none outside a
    Hydra run. Read unresolved: an override's value may hold an interpolation (`name=${nope}`),
    which its own check names."""
    if not HydraConfig.initialized():
        return set()
    task = OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)
    return {str(o).lstrip("+~").partition("=")[0] for o in task}


def set_beyond_option(group: str, node: DictConfig, keys: tuple[str, ...]) -> set[str]:
    """Which of `keys` of `node` (the group's composed config) an added config set: the chosen
    experiment names them under `group`, or they hold another value than the chosen option's
    own file gives them. Empty outside a Hydra run; options and experiments accel-train does
    not ship (a user's config dir) count by value only where the file is found."""
    if not HydraConfig.initialized():
        return set()
    choices = HydraConfig.get().runtime.choices
    found = set()
    experiment = CONFIG_DIR / "experiment" / f"{choices.get('experiment')}.yaml"
    if choices.get("experiment") and experiment.is_file():
        named = OmegaConf.load(experiment).get(group) or {}
        found |= {k for k in keys if k in named}
    option = CONFIG_DIR / group / f"{choices.get(group)}.yaml"
    if choices.get(group) and option.is_file():
        own = OmegaConf.load(option)
        found |= {k for k in keys if k in node and k in own and node[k] != own[k]}
    return found


def group_chosen(group: str) -> bool:
    """Whether the user chose `group`'s option: on the command line (`group=option`), or through
    an added config (an experiment) that picks another than train.yaml's default. True outside
    a Hydra run: a config built in code means what it says."""
    if not HydraConfig.initialized():
        return True
    if group in command_line_keys():
        return True
    hydra_cfg = HydraConfig.get()
    defaults = OmegaConf.load(CONFIG_DIR / "train.yaml").defaults
    default = next((e[group] for e in defaults if isinstance(e, DictConfig) and group in e), None)
    return hydra_cfg.runtime.choices.get(group) != default


def load_run_config(path: str | Path) -> DictConfig:
    """Load a resolved config written by the launcher, typed against the schema again."""
    # resolve=True: the file is resolved already, except the literal `${` escaped by typed().
    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(loaded, dict):
        raise UserError(f"{path} is not an accel-train run config (no mapping at the top).")
    return typed(loaded)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: dotted keys, to name the first key two configs differ in."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def write_run_config(cfg: DictConfig, run_dir: Path, name: str = "config.yaml") -> Path:
    """Write the resolved config (atomically) and its tree rendering into the run dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / name
    tmp = path.with_name(f".{name}.tmp-{os.getpid()}")
    tmp.write_text(OmegaConf.to_yaml(cfg))
    os.replace(tmp, path)
    if name == "config.yaml":
        buffer = io.StringIO()
        Console(file=buffer, width=100, no_color=True).print(config_tree(cfg))
        (run_dir / "config_tree.txt").write_text(buffer.getvalue())
    return path


def config_tree(cfg: DictConfig) -> Tree:
    tree = Tree("[bold]config[/bold]", guide_style="dim")
    for key, value in cfg.items():
        if isinstance(value, DictConfig):
            branch = tree.add(f"[bold cyan]{key}[/bold cyan]")
            for k, v in value.items():
                branch.add(f"{k}: {v}")
        else:
            tree.add(f"{key}: {value}")
    return tree
