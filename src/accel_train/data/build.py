"""`dataset` config -> Splits: instantiate the option's ``_target_`` and check its contract
(items are ``(input, target)`` pairs, labels in ``[0, num_classes)``) before training starts."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset, Subset, TensorDataset

from accel_train.config.schema import DATASET_COMMON_KEYS, DATASET_RECIPE_KEYS
from accel_train.data.splits import ImageSet, Splits, held_out_indices
from accel_train.errors import UserError
from accel_train.targets import build

log = logging.getLogger("accel_train")

# How many items of a split without a label tensor are read to check the labels up front (the
# torch loader checks every batch's labels on the host as well).
LABEL_SAMPLE = 256
# The most labels counted to find a user set's number of classes (see _counted_classes).
COUNT_LIMIT = 100_000_000


def build_splits(
    ds: DictConfig, data_dir: str, labelled: bool = True, task: DictConfig | None = None
) -> Splits:
    """The splits. `labelled`: items are (input, class index) pairs, checked against the number
    of classes (classification); otherwise an item may be any structure of tensors (a tuple, a
    dict, nested) and only the splits' sizes are checked. `task`: the run's task config, checked
    against the one task the data can feed (Splits.only_task), if any."""
    own = (*DATASET_COMMON_KEYS, "val_fraction", "seed")  # passed when the target names them
    # ...and set: a key left null (num_classes) leaves the target's own default in place
    given = {k: ds[k] for k in own if ds.get(k) is not None}
    # The recipe switches are applied around the factory's splits (data/images/sample_recipe.py),
    # not by it.
    exclude = (*own, *DATASET_RECIPE_KEYS)
    made = build(ds, "dataset", optional={"data_dir": data_dir, **given}, exclude=exclude)
    if isinstance(made, Splits):
        splits = made
        check_task_fits(splits, ds, task, labelled)
    elif labelled:
        splits = _from_user(made, ds)
    else:
        splits = _unlabelled(made, ds)
    if ds.get("num_classes") is not None:
        splits.num_classes = int(ds.num_classes)
    for name in ("train", "val", "test"):
        split = getattr(splits, name)
        if split is not None:
            if labelled:
                check_split(split, name, splits.num_classes, ds)
            elif len(split) == 0:
                raise UserError(
                    f"dataset={ds.name}: the {name} split is empty. Check the data (or "
                    "dataset.val_fraction, which must leave samples on both sides)."
                )
    return splits


def check_task_fits(
    splits: Splits, ds: DictConfig, task: DictConfig | None, labelled: bool
) -> None:
    """Data that feeds one task only (token windows: a language model) with another of the
    built-in tasks: one paragraph naming the fix, not an error about the first item's target. A
    task of the user's own (task=custom) may read any data."""
    want = splits.only_task
    if want is None or (task is not None and task.get("name") == want):
        return
    ours = task is None or str(task.get("_target_", "")).startswith("accel_train.tasks.")
    if ours and (labelled or task is not None):
        have = task.get("name") if task is not None else "classification"
        raise UserError(
            f"dataset={ds.name} feeds only task={want} (its items are "
            f"{splits.only_task_items}), but the run's task is {have}. Set "
            f"`task={want}` (or leave task= out: dataset={ds.name} picks it), or use "
            "`task=custom` with a step of your own."
        )


def _unlabelled(made: Any, ds: DictConfig) -> Splits:
    """A user factory's splits for a task without class labels: items of any structure. The
    data's shape (in_channels, image_size) is read from a first tensor that looks like an
    image, else 0."""
    train, val, test = _three(made, ds, labels=None)
    item = train[0]
    first = item if isinstance(item, torch.Tensor) else _first_tensor(item)
    c, size = (
        (first.shape[0], first.shape[-1]) if first is not None and first.dim() == 3 else (0, 0)
    )
    return Splits(train, val, test, in_channels=c, image_size=size, num_classes=0)


def _first_tensor(item: Any) -> torch.Tensor | None:
    values = item.values() if isinstance(item, Mapping) else item
    for value in values if isinstance(values, Sequence | type({}.values())) else ():
        if isinstance(value, torch.Tensor):
            return value
    return None


def _three(made: Any, ds: DictConfig, labels) -> tuple[Any, Any, Any]:
    """(train, val, test) from a dict, a tuple, or one Dataset (held out by val_fraction)."""
    target = ds._target_
    if isinstance(made, Mapping):
        if "train" not in made or "val" not in made:
            raise UserError(
                f"dataset._target_={target} returned a dict with keys {sorted(made)}; it needs "
                "'train' and 'val' (and optionally 'test')."
            )
        train, val, test = made["train"], made["val"], made.get("test")
    elif isinstance(made, tuple | list) and len(made) in (2, 3):
        train, val, test = (*made, None)[:3]
    elif isinstance(made, Dataset):
        indices = held_out_indices(len(made), ds.val_fraction, ds.seed, labels)
        train, val, test = (
            Subset(made, indices[0].tolist()),
            Subset(made, indices[1].tolist()),
            None,
        )
    else:
        raise UserError(
            f"dataset._target_={target} returned {type(made).__name__}; it must return a torch "
            "Dataset, a tuple (train, val) or (train, val, test) of Datasets, or a dict with "
            "those keys."
        )
    for name, split in (("train", train), ("val", val), ("test", test)):
        if split is not None and not (hasattr(split, "__getitem__") and hasattr(split, "__len__")):
            raise UserError(
                f"dataset._target_={target}: its {name} split is a {type(split).__name__}, not "
                "a map-style Dataset (with __len__ and __getitem__)."
            )
    return train, val, test


def _from_user(made: Any, ds: DictConfig) -> Splits:
    """A user factory's return value: a Dataset, (train, val[, test]) or a dict of them."""
    target = ds._target_
    labels = _label_tensor(made) if isinstance(made, Dataset) else None
    train, val, test = _three(made, ds, labels)
    num_classes = ds.num_classes
    if num_classes is None:
        classes = getattr(train, "classes", None) or getattr(
            getattr(train, "dataset", None), "classes", None
        )
        num_classes = len(classes) if classes else _counted_classes((train, val, test), target)
    sample, _ = _item(train, 0, "train", target)
    token_ids = sample.dim() == 1 and not sample.is_floating_point() and sample.dtype != torch.uint8
    if sample.dim() != 3 and not token_ids:
        raise UserError(
            f"dataset._target_={target}: inputs must be image tensors [C, H, W] or token ids "
            f"[T] (integers, for a text classifier such as model=hf "
            f"model.head=sequence_classification); the first training input has shape "
            f"{tuple(sample.shape)} ({sample.dtype})."
        )
    c, _, size = sample.shape if not token_ids else (0, 0, 0)
    return Splits(
        train,
        val,
        test,
        in_channels=c,
        image_size=size,
        num_classes=int(num_classes),
        random_shift=ds.random_shift,
        random_hflip=ds.random_hflip,
    )


def _counted_classes(splits: tuple, target: str) -> int:
    """A user set without `.classes`: the number of classes counted from its labels where that
    is cheap (labels kept apart from the inputs: a `targets` or `labels` tensor or list, a
    TensorDataset, up to COUNT_LIMIT of them; or a split of at most LABEL_SAMPLE items, which
    check_split reads anyway), said in one log line. A larger split that keeps no labels apart
    would have to be read whole: the user says how many."""
    highest = -1
    for name, split in zip(("train", "val", "test"), splits, strict=True):
        if split is None:
            continue
        labels = _label_tensor(split)
        if labels is None and len(split) <= LABEL_SAMPLE:
            labels = torch.tensor([_item(split, i, name, target)[1] for i in range(len(split))])
        if labels is None or labels.numel() > COUNT_LIMIT:
            if name == "train":
                raise UserError(
                    f"dataset._target_={target}: how many classes? The train set has no "
                    f"`.classes`, and its {len(split):,} labels are not kept apart from the "
                    "inputs (a `targets` tensor or list), so counting them would read the whole "
                    "data set. Set `dataset.num_classes=N` (or give the set a `classes` list or "
                    "a `targets` list of its labels)."
                )
            continue  # the train split's count stands; check_split checks this split's labels
        if labels.numel():
            highest = max(highest, int(labels.max()))
    log.info(
        "dataset._target_=%s has no `.classes`: %d classes counted from its labels (0-%d); "
        "set dataset.num_classes to say otherwise",
        target,
        highest + 1,
        highest,
    )
    return highest + 1


def _item(split: Dataset, i: int, name: str, target: str) -> tuple[torch.Tensor, int]:
    item = split[i]
    if not (isinstance(item, Sequence | tuple) and len(item) == 2):
        kind = f"a {len(item)}-tuple" if isinstance(item, tuple | list) else type(item).__name__
        raise UserError(
            f"dataset._target_={target}: item {i} of the {name} split is {kind}; every item must "
            "be a pair (input tensor, integer class index)."
        )
    x, y = item
    if not isinstance(x, torch.Tensor):
        raise UserError(
            f"dataset._target_={target}: the input of item {i} of the {name} split is a "
            f"{type(x).__name__}, not a tensor (convert it, e.g. with "
            "torchvision.transforms.v2.functional.to_image)."
        )
    if isinstance(y, torch.Tensor) and y.numel() == 1 and not y.is_floating_point():
        y = int(y)
    if not isinstance(y, int):
        raise UserError(
            f"dataset._target_={target}: the target of item {i} of the {name} split is "
            f"{y!r}; it must be an integer class index."
        )
    return x, y


def check_split(split: Dataset, name: str, num_classes: int, ds: DictConfig) -> None:
    if len(split) == 0:
        raise UserError(
            f"dataset={ds.name}: the {name} split is empty. Check the data (or "
            "dataset.val_fraction, which must leave samples on both sides)."
        )
    labels = _label_tensor(split)
    if labels is None:
        n = min(len(split), LABEL_SAMPLE)
        labels = torch.tensor([_item(split, i, name, ds._target_)[1] for i in range(n)])
    check_labels(labels, num_classes)


def check_labels(labels: torch.Tensor, num_classes: int) -> None:
    """Labels on the host (no device sync): every one in [0, num_classes)."""
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= num_classes:
        bad = low if low < 0 else high
        raise UserError(
            f"dataset.num_classes={num_classes} but the data has label {bad}: labels must be in "
            f"[0, {num_classes}). Set `dataset.num_classes` to the number of classes, or fix "
            "the labels."
        )


def _label_tensor(split: Dataset) -> torch.Tensor | None:
    """All labels of a split without loading its inputs, when the split keeps them apart."""
    if isinstance(split, ImageSet):
        return split.labels
    if isinstance(split, TensorDataset) and len(split.tensors) == 2:
        return split.tensors[1].flatten()
    if isinstance(split, Subset):
        inner = _label_tensor(split.dataset)
        return None if inner is None else inner[torch.as_tensor(split.indices, dtype=torch.long)]
    for attr in ("targets", "labels"):
        value = getattr(split, attr, None)
        if isinstance(value, torch.Tensor | list) and len(value) == len(split):
            return torch.as_tensor(value).flatten()
    return None
