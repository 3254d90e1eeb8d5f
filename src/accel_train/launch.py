"""Compose once, resolve once, write <run_dir>/config.yaml, then run: here or under torchrun."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.tree import Tree

from accel_train.config import TrainConfig, to_container, validate

log = logging.getLogger("accel_train")


def resolve(cfg: DictConfig) -> DictConfig:
    """The composed config with every interpolation evaluated, typed against the schema.

    After this nothing refers to Hydra's runtime any more, so a worker can load the file."""
    resolved = OmegaConf.merge(OmegaConf.structured(TrainConfig), to_container(cfg))
    assert isinstance(resolved, DictConfig)
    return resolved


def write_run_config(cfg: DictConfig, run_dir: Path, show: bool = True) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(OmegaConf.to_yaml(cfg))
    os.replace(tmp, path)
    buffer = io.StringIO()
    Console(file=buffer, width=100, no_color=True).print(config_tree(cfg))
    (run_dir / "config_tree.txt").write_text(buffer.getvalue())
    if show:
        Console(stderr=False).print(config_tree(cfg))
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


def launch(cfg: DictConfig) -> float | None:
    validate(cfg)
    resolved = resolve(cfg)
    run_dir = Path(resolved.paths.output_dir)
    write_run_config(resolved, run_dir, show=resolved.trainer.progress != "none")
    summary = run_local(resolved)
    return summary.get("best_val_acc")


def run_local(cfg: DictConfig) -> dict[str, Any]:
    from accel_train.train import run_training

    return run_training(cfg)
