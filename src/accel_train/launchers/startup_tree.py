"""The start-up tree a launch prints: the chosen options and the values that differ from their
defaults, read from the options' own files (no second compose)."""

from __future__ import annotations

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from accel_train.config import CONFIG_DIR
from accel_train.config.run_config import config_tree
from accel_train.console import flat_defaults, startup_tree


def launch_tree(cfg: DictConfig):
    """The chosen options and the values that differ from their defaults (the full tree is
    config_tree.txt). Without a second compose (~0.2 s): the values that can differ are those
    the command line sets and those the added groups' files (experiment, debug) set; each is
    compared with the default its chosen option's own file (or that option's schema) gives
    (`_option_defaults`). Outside a Hydra run (or if that fails), the full tree as before."""
    try:
        hydra_cfg = HydraConfig.get()
        runtime = hydra_cfg.runtime.choices
        primary = OmegaConf.load(CONFIG_DIR / "train.yaml").defaults
        default_choices = {
            k: v for entry in primary if isinstance(entry, DictConfig) for k, v in entry.items()
        }
        groups = [g for g in default_choices if g not in ("hydra", "paths", "hparams_search")]
        choices = {g: runtime[g] for g in groups if runtime.get(g)}
        repo = GlobalHydra.instance().config_loader().repository
        changed = _set_keys(list(hydra_cfg.overrides.task), runtime, default_choices, repo)
        flat = _option_defaults(changed, runtime, repo)
    except Exception:  # noqa: BLE001 - a display nicety: never fail a run on it
        return config_tree(cfg)
    return startup_tree(cfg, choices, default_choices, flat, keys=changed)


def _set_keys(
    overrides: list[str], runtime: DictConfig, default_choices: dict, repo: object
) -> set[str]:
    """The dotted leaf keys the command line and the added groups' files (experiment, debug:
    groups with no default in train.yaml) set."""
    keys: set[str] = set()
    for group, option in runtime.items():
        if group in default_choices or group.startswith("hydra") or not isinstance(option, str):
            continue
        loaded = repo.load_config(f"{group}/{option}")
        if loaded is None:
            continue
        package = loaded.header.get("package") or group
        node = OmegaConf.to_container(loaded.config, resolve=False)
        node.pop("defaults", None)
        prefix = "" if package == "_global_" else f"{package.removeprefix('_global_.')}."
        keys.update(prefix + k for k in flat_defaults(node))
    for line in overrides:
        key, _, value = line.lstrip("+~").partition("=")
        if not key or key in runtime or line.startswith("~"):
            continue
        nested = _as_dict(value)
        if nested:
            keys.update(f"{key}.{k}" for k in flat_defaults(nested))
        else:
            keys.add(key)
    return keys


def _as_dict(value: str) -> dict:
    """`key={a: 1}` sets key.a: the dict an override's value is, else {}."""
    if not value.startswith("{"):
        return {}
    node = OmegaConf.create(value)
    return OmegaConf.to_container(node) if isinstance(node, DictConfig) else {}


def _option_defaults(keys: set[str], runtime: DictConfig, repo: object) -> dict[str, object]:
    """Each key's default: from the file of its group's chosen option, else from that option's
    schema (the first entry of the file's defaults list); top-level keys from train.yaml and
    its schema. A key found in neither is missing from the result (shown as added)."""
    sources: dict[str, list[DictConfig]] = {}

    def chain(group: str) -> list[DictConfig]:
        if group not in sources:
            option = runtime.get(group) if group else "train"
            found: list[DictConfig] = []
            path = f"{group}/{option}" if group else "train"
            while isinstance(option, str) and path and len(found) < 3:
                loaded = repo.load_config(path)
                if loaded is None:
                    break
                found.append(loaded.config)
                first = (loaded.config.get("defaults") or [None])[0]  # the schema, if any
                path = None
                if isinstance(first, str) and not first.startswith("override"):
                    path = f"{group}/{first}" if group else first
            sources[group] = found
        return sources[group]

    defaults: dict[str, object] = {}
    for key in keys:
        group, _, rest = key.partition(".")
        group, rest = (group, rest) if rest and group in runtime else ("", key)
        for node in chain(group):
            value = OmegaConf.select(node, rest, default=_ABSENT, throw_on_missing=False)
            if value is not _ABSENT:
                defaults[key] = (
                    OmegaConf.to_container(value)
                    if isinstance(value, DictConfig | ListConfig)
                    else value
                )
                break
    return defaults


_ABSENT = object()
