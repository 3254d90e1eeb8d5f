"""Schemas put in Hydra's ConfigStore without converting them at start-up.

`ConfigStore.store` turns each dataclass into an OmegaConf node at once (`OmegaConf.structured`):
for accel-train's ~75 schemas ~0.15 s of CPU in every command, while a run's compose reads ~20
of them. A `LazyConfigNode` converts its schema the first time Hydra loads it (ConfigStore.load,
which copies the node it returns) and keeps the result for the next load."""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigNode, ConfigStore
from omegaconf import DictConfig, OmegaConf


class LazyConfigNode(ConfigNode):
    """A ConfigNode whose `node` is made from `schema` when first read."""

    def __init__(self, name: str, schema: Any, group: str | None, provider: str | None):
        self._box: list[Any] = [schema, None]  # [what to convert, the converted node]
        self._open = group is not None  # an option's schema (the root schemas stay closed)
        super().__init__(name=name, node=None, group=group, package=None, provider=provider)

    @property  # type: ignore[override]
    def node(self) -> Any:
        box = self._box
        if box[1] is None:
            node = OmegaConf.structured(box[0])
            box[1] = open_mappings(node) if self._open else node
        return box[1]

    @node.setter
    def node(self, value: Any) -> None:
        if value is not None:  # ConfigStore.load's copy gets its own deep copy
            self._box = [None, value]


def open_mappings(node: Any) -> Any:
    """A schema's mapping fields (`dict[str, float]`, ...) left open: their keys are the user's
    own (loader.resources.cpu_node=1), set without Hydra's `+` as any other key; the rest of
    the schema stays closed (struct). Nested schemas too."""
    if not isinstance(node, DictConfig):
        return node
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            if child._metadata.object_type in (None, dict):
                OmegaConf.set_struct(child, False)
            else:
                open_mappings(child)
    return node


def store_lazily(
    name: str, schema: Any, group: str | None = None, provider: str | None = None
) -> None:
    """`ConfigStore.instance().store(name=..., node=schema, group=...)`, converted on first use."""
    cur = ConfigStore.instance().repo
    for part in group.split("/") if group else ():
        cur = cur.setdefault(part, {})
    cur[f"{name}.yaml"] = LazyConfigNode(f"{name}.yaml", schema, group, provider)
