"""The built-in data sets as in-memory uint8 tensors: torchvision's MNIST family and CIFAR-10,
and synthetic digits generated from a seed. Validation is held out of the training split."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from accel_train.data.splits import ImageSet, Splits, held_out_indices
from accel_train.errors import UserError

log = logging.getLogger("accel_train")

TORCHVISION_SETS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "cifar10": "CIFAR10"}


def torchvision_splits(
    *,
    name: str,
    data_dir: str,
    download: bool = True,
    val_fraction: float = 0.1,
    seed: int = 0,
    random_shift: int = 0,
    random_hflip: bool = False,
) -> Splits:
    """The official train split less a seeded, stratified held-out part; the official test
    split as the test split."""
    train_pool, classes = _load_torchvision(name, data_dir, download, train=True)
    test, _ = _load_torchvision(name, data_dir, download, train=False)
    train, val = hold_out(train_pool, val_fraction, seed, test)
    _, c, size, _ = train.images.shape
    return Splits(train, val, test, c, size, classes, None, random_shift, random_hflip)


def synthetic_splits(
    *,
    in_channels: int = 1,
    image_size: int = 28,
    num_classes: int = 10,
    num_train: int = 2048,
    num_test: int = 512,
    val_fraction: float = 0.1,
    seed: int = 0,
    random_shift: int = 0,
    random_hflip: bool = False,
) -> Splits:
    shape = (in_channels, image_size, num_classes)
    pool = synthetic_digits(*shape, n=num_train, seed=seed, draw=1)
    test = synthetic_digits(*shape, n=num_test, seed=seed, draw=2)
    train, val = hold_out(pool, val_fraction, seed, test)
    return Splits(
        train, val, test, in_channels, image_size, num_classes, None, random_shift, random_hflip
    )


def hold_out(
    pool: ImageSet, fraction: float, seed: int, test: ImageSet
) -> tuple[ImageSet, ImageSet]:
    """(train, val) from the training pool; fraction 0 validates on the test split."""
    if fraction == 0:
        log.warning(
            "dataset.val_fraction=0: validating on the test split, so best.pt is selected on "
            "test data and its test accuracy is optimistic. Hold out part of the training data "
            "(e.g. dataset.val_fraction=0.1) for an honest test number."
        )
        return pool, test
    train_idx, val_idx = held_out_indices(len(pool), fraction, seed, pool.labels)
    return pool.subset(train_idx), pool.subset(val_idx)


def _load_torchvision(name: str, data_dir: str, download: bool, train: bool):
    import torchvision  # 3 s to import: only when a torchvision data set is used

    cls = getattr(torchvision.datasets, TORCHVISION_SETS[name])
    root = Path(data_dir).expanduser()
    try:
        tv = cls(root=str(root), train=train, download=False)
    except RuntimeError:
        if not download:
            raise UserError(_missing_message(name, root, "dataset.download=false")) from None
        try:
            tv = cls(root=str(root), train=train, download=True)
        except Exception as err:  # torchvision raises several types for network failures
            # torchvision's message: "Error downloading <file>:" ... "<the cause>" on its last line.
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [""]
            cause = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
            reason = f"the download failed ({type(err).__name__}: {cause[:300]})"
            raise UserError(_missing_message(name, root, reason)) from None
    if name == "cifar10":
        images = torch.from_numpy(tv.data).permute(0, 3, 1, 2).contiguous()
        labels = torch.tensor(tv.targets, dtype=torch.int64)
    else:
        images = tv.data.unsqueeze(1).contiguous()
        labels = tv.targets.to(torch.int64)
    return ImageSet(images, labels), len(tv.classes)


def _missing_message(name: str, root: Path, reason: str) -> str:
    folder = root / ("cifar-10-batches-py" if name == "cifar10" else TORCHVISION_SETS[name])
    return (
        f"dataset={name}: the files are not under {folder.resolve()} and {reason}. "
        f"Put the files there (torchvision's layout), point `paths.data_dir=...` (or "
        f"$ACCEL_TRAIN_DATA_DIR) at the folder that holds them, or train offline with "
        f"`dataset=synthetic`."
    )


def synthetic_digits(
    channels: int, size: int, classes: int, *, n: int, seed: int, draw: int
) -> ImageSet:
    """Learnable MNIST-shaped data: one blurry stroke template per class, shifted and noised.

    Fully determined by ``seed``; each ``draw`` is an independent sample of the same classes."""
    gen = torch.Generator().manual_seed(seed)
    coarse = (torch.rand(classes, channels, 6, 6, generator=gen) > 0.6).float()
    templates = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    gen.manual_seed(seed * 2 + draw)
    labels = torch.randint(0, classes, (n,), generator=gen)
    images = templates[labels]
    shifts = torch.randint(-3, 4, (n, 2), generator=gen)
    for i, (dy, dx) in enumerate(shifts.tolist()):
        images[i] = torch.roll(images[i], shifts=(dy, dx), dims=(1, 2))
    images = images * torch.empty(n, 1, 1, 1).uniform_(0.6, 1.0, generator=gen)
    images = images + 0.25 * torch.randn(images.shape, generator=gen)
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    return ImageSet(images, labels)
