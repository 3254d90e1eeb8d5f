"""What every data set option builds: train / val / test splits plus the data's shape.

A split is any map-style torch Dataset whose items are ``(input, target)``: ``input`` a uint8
image tensor ``[C, H, W]`` (normalised on the device by ``BatchTransform`` with
``dataset.mean``/``dataset.std``) or a float tensor (used as it is), ``target`` an int class
index. In-memory image sets are :class:`ImageSet` (uint8 tensors), which ``loader=device`` can
hold on the device whole.

A split may also implement ``getitem(index, epoch)``: the torch loader then calls it instead of
``__getitem__``, so per-sample random augmentation can be seeded by (index, epoch) and give the
same batches for any ``num_workers`` and after a mid-epoch resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset

# A batch of uint8 images on the device -> augmented uint8 images of the training size
# (e.g. a random resized crop done for the whole batch at once). Seeded by the generator.
DeviceAugment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
# A batch of float signal windows on the device -> the model's features (a log-mel spectrogram,
# I/Q normalised per example): (windows, train, generator or None in evaluation).
DeviceFeatures = Callable[[torch.Tensor, bool, torch.Generator | None], torch.Tensor]


@dataclass
class EvalGroups:
    """A per-sample field that evaluation scores apart (a radio burst's SNR): evaluation items
    are ``(input, class, group index)``, and the classifier logs ``acc_<name>/<value>`` for each
    of ``values`` (the group index's meaning, in order)."""

    name: str
    values: list[float]

    def metric(self, i: int) -> str:
        return f"acc_{self.name}/{self.values[i]:g}"


@dataclass
class ImageSet(Dataset):
    """A whole split as two tensors (what ``loader=device`` puts on the device)."""

    images: torch.Tensor  # uint8 [N, C, H, W]
    labels: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i])

    def subset(self, indices: torch.Tensor) -> ImageSet:
        return ImageSet(self.images[indices], self.labels[indices])

    def nbytes(self) -> int:
        return self.images.numel() * self.images.element_size() + self.labels.numel() * 8


@dataclass
class Splits:
    train: Dataset
    val: Dataset
    test: Dataset | None  # None: the data set has no test split (test_after_fit is skipped)
    in_channels: int
    image_size: int
    num_classes: int
    # uint8 training batches on the device -> augmented batches (None: none of its own).
    device_augment: DeviceAugment | None = None
    # Simple augmentations the device transform applies to uint8 training batches (the built-in
    # sets pass dataset.random_shift / random_hflip here; a set that augments by itself, 0/False).
    random_shift: int = 0
    random_hflip: bool = False
    # What the data tells the model's constructor beyond the shape (a token folder's
    # vocab_size): passed when the constructor names it.
    model_args: dict = field(default_factory=dict)
    # The one task option this data can feed (token windows: "language_model"); None: any.
    only_task: str | None = None
    # What its items are, for the refusal of another task (data/build.py's check_task_fits).
    only_task_items: str = "token ids and the next tokens, no class labels"
    # Float signal batches on the device -> the model's input (data/signals/features.py); the
    # device transform applies it after the copy. None: none of its own.
    device_features: DeviceFeatures | None = None
    # A per-sample field validation scores apart (a radio set's SNR), or None.
    groups: EvalGroups | None = None
    # The classes' names in label order (a folder's class folders), or None: accel-eval's
    # per-class accuracy and predictions name them (their indices where None).
    class_names: list[str] | None = None

    @property
    def data_args(self) -> dict:
        """What the data tells the model's constructor and the task: the input's shape, the
        number of classes (0: none) and model_args."""
        shape = {"in_channels": self.in_channels, "image_size": self.image_size}
        return {**shape, "num_classes": self.num_classes, **self.model_args}


def held_out_indices(
    n: int, fraction: float, seed: int, labels: torch.Tensor | None = None, min_per_class: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, validation indices): a seeded ``fraction`` of ``range(n)`` held out.

    With ``labels`` the split is stratified: each class gives the same share (rounded), so a
    class-balanced set stays balanced in both parts. ``min_per_class`` (video folders: 1) is the
    least a class gives when it keeps one for training (1 % of a small folder rounds to none).
    The same (n, fraction, seed, labels) always gives the same split, whatever ``trainer.seed``
    is.

    The validation indices come in a seeded random order, not sorted: validation reads them in
    order, and `trainer.limit_val_batches` takes the first batches, which for data stored by
    class (an ImageFolder tree) would otherwise be one or two classes."""
    gen = torch.Generator().manual_seed(seed)
    if labels is None:
        order = torch.randperm(n, generator=gen)
        k = round(n * fraction)
        return order[k:].sort().values, order[:k]
    val_parts = []
    for c in labels.unique().tolist():
        members = (labels == c).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=gen)]
        k = round(len(members) * fraction)
        if fraction > 0 and k < min_per_class:
            k = min(min_per_class, len(members) - 1)  # one always stays for training
        val_parts.append(members[: max(k, 0)])
    val = torch.cat(val_parts) if val_parts else torch.empty(0, dtype=torch.long)
    val = val[torch.randperm(len(val), generator=gen)]
    keep = torch.ones(n, dtype=torch.bool)
    keep[val] = False
    return keep.nonzero().flatten(), val
