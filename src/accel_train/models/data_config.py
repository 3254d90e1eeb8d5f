"""A model's pretrained data config handed to the dataset, once, in the launching process.

model=timm and model=torchvision models were trained with a preprocessing of their own (timm's
`pretrained_cfg`: mean, std, input size, interpolation, crop_pct; torchvision's weights'
`transforms()`). It sets the dataset's keys of the same meaning (`mean`, `std`, and
`crop_pct` / `interpolation` where the dataset option has them) before config.yaml is written,
so that every worker, resume, accel-eval and accel-export read the same values; a key the user
set (on the command line, or in an experiment: another value than the dataset option's file
gives it) stays theirs. The run's log says which values came from where.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from accel_train.config.run_config import command_line_keys, set_beyond_option

log = logging.getLogger("accel_train")

# The dataset keys a pretrained config sets, by the key's name in timm's pretrained_cfg.
KEYS = ("mean", "std", "crop_pct", "interpolation")


def fit_channels(values: list[float], channels: int | None) -> list[float] | None:
    """`values` for `channels` image channels: as they are when they match (or are one value,
    which the dataset applies to every channel), their mean for one channel (what timm does for
    a grayscale model), None when they cannot fit."""
    if channels is None or len(values) in (1, channels):
        return values
    if channels == 1:
        return [round(sum(values) / len(values), 6)]
    return None


def apply_data_config(cfg: DictConfig, data: Mapping[str, Any], model: str, source: str) -> None:
    """Set cfg.dataset's KEYS from `data` (a pretrained config) where the dataset has the key
    and the user did not set it (on the command line or in an experiment); logs one line naming
    them."""
    dataset = cfg.dataset
    if not data or "mean" not in dataset:  # not an image data set
        return
    user = command_line_keys() | {
        f"dataset.{k}" for k in set_beyond_option("dataset", dataset, KEYS)
    }
    channels = dataset.get("in_channels") or len(dataset.mean)
    taken, kept = {}, []
    for key in KEYS:
        value = data.get(key)
        if value is None or key not in dataset:
            continue
        if f"dataset.{key}" in user:
            kept.append(key)
            continue
        if key in ("mean", "std"):
            value = fit_channels([float(v) for v in value], channels)
            if value is None:
                kept.append(key)
                continue
        taken[key] = value
    for key, value in taken.items():
        dataset[key] = value
    if taken or kept:
        shown = ", ".join(f"dataset.{k}={v}" for k, v in taken.items()) or "no dataset key"
        why = f" (kept the run's own dataset.{', dataset.'.join(kept)})" if kept else ""
        log.info("%s: %s %s%s", model, shown, source, why)
    size = (data.get("input_size") or [None])[-1]
    if size and dataset.get("image_size") not in (None, size):
        log.info(
            "%s: its pretrained input size is %d px, this run's dataset.image_size=%s",
            model,
            size,
            dataset.image_size,
        )
