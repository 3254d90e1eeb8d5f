"""Data sets as uint8 image tensors, the two loaders, and the on-device batch transform.

Both loaders (``torch``: a DataLoader with per-item ``__getitem__``; ``device``: the whole set as
one tensor on the device) draw their order from :class:`ShardedOrder`, so for the same seed they
give the same batches. Both hand over raw uint8 images; :class:`BatchTransform` augments and
normalises them on the device, where it is cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

from accel_train.config import UserError

log = logging.getLogger(__name__)

# The label of padding samples in sharded validation: cross_entropy ignores it, so every test
# example counts exactly once however the set divides among ranks.
IGNORE_INDEX = -100

TORCHVISION_SETS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "cifar10": "CIFAR10"}


@dataclass
class ImageSet:
    images: torch.Tensor  # uint8 [N, C, H, W]
    labels: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return len(self.labels)


def load_split(ds: DictConfig, data_dir: str, train: bool) -> ImageSet:
    """The train or test split of the configured data set, as uint8 tensors on the CPU."""
    if ds.name == "synthetic":
        return synthetic_digits(ds, train)
    return _load_torchvision(ds, data_dir, train)


def _load_torchvision(ds: DictConfig, data_dir: str, train: bool) -> ImageSet:
    import torchvision

    cls = getattr(torchvision.datasets, TORCHVISION_SETS[ds.name])
    root = Path(data_dir).expanduser()
    try:
        tv = cls(root=str(root), train=train, download=False)
    except RuntimeError:
        if not ds.download:
            raise UserError(_missing_message(ds, root, "dataset.download=false")) from None
        try:
            tv = cls(root=str(root), train=train, download=True)
        except Exception as err:  # torchvision raises several types for network failures
            # torchvision's message: "Error downloading <file>:" ... "<the cause>" on its last line.
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [""]
            cause = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
            reason = f"the download failed ({type(err).__name__}: {cause[:300]})"
            raise UserError(_missing_message(ds, root, reason)) from None
    if ds.name == "cifar10":
        images = torch.from_numpy(tv.data).permute(0, 3, 1, 2).contiguous()
        labels = torch.tensor(tv.targets, dtype=torch.int64)
    else:
        images = tv.data.unsqueeze(1).contiguous()
        labels = tv.targets.to(torch.int64)
    return ImageSet(images, labels)


def _missing_message(ds: DictConfig, root: Path, reason: str) -> str:
    folder = root / ("cifar-10-batches-py" if ds.name == "cifar10" else TORCHVISION_SETS[ds.name])
    return (
        f"dataset={ds.name}: the files are not under {folder.resolve()} and {reason}. "
        f"Put the files there (torchvision's layout), point `paths.data_dir=...` (or "
        f"$ACCEL_TRAIN_DATA_DIR) at the folder that holds them, or train offline with "
        f"`dataset=synthetic`."
    )


def synthetic_digits(ds: DictConfig, train: bool) -> ImageSet:
    """Learnable MNIST-shaped data: one blurry stroke template per class, shifted and noised.

    Fully determined by ``dataset.seed``; train and val are disjoint draws from the same templates.
    """
    size, channels, classes = ds.image_size, ds.in_channels, ds.num_classes
    gen = torch.Generator().manual_seed(ds.seed)
    coarse = (torch.rand(classes, channels, 6, 6, generator=gen) > 0.6).float()
    templates = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    gen.manual_seed(ds.seed * 2 + (1 if train else 2))
    n = ds.num_train if train else ds.num_val
    labels = torch.randint(0, classes, (n,), generator=gen)
    images = templates[labels]
    shifts = torch.randint(-3, 4, (n, 2), generator=gen)
    for i, (dy, dx) in enumerate(shifts.tolist()):
        images[i] = torch.roll(images[i], shifts=(dy, dx), dims=(1, 2))
    images = images * torch.empty(n, 1, 1, 1).uniform_(0.6, 1.0, generator=gen)
    images = images + 0.25 * torch.randn(images.shape, generator=gen)
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    return ImageSet(images, labels)


class ShardedOrder:
    """Which sample indices this rank sees, batch by batch, in a given epoch.

    Training: a permutation seeded by ``seed + epoch`` (like DistributedSampler), truncated to a
    multiple of the world size and strided by rank, so the union of the ranks' k-th batches is the
    k-th batch of the single-process run. Evaluation: all indices in order, padded with -1 to a
    multiple of the world size (the padding is labelled IGNORE_INDEX by the loaders).
    """

    def __init__(self, n, batch_size, *, train, shuffle, seed, rank, world, drop_last, limit):
        self.n, self.batch_size, self.train, self.shuffle = n, batch_size, train, shuffle
        self.seed, self.rank, self.world, self.drop_last = seed, rank, world, drop_last
        per_rank = (n // world) if train else -(-n // world)
        full, rest = divmod(per_rank, batch_size)
        self.num_batches = full + (1 if rest and not (train and drop_last) else 0)
        if limit:
            self.num_batches = min(self.num_batches, limit)
        self.epoch, self.start_batch = 0, 0

    def batch_len(self, b: int) -> int:
        """Samples in this rank's batch b (the last batch of an epoch may be short)."""
        per_rank = (self.n // self.world) if self.train else -(-self.n // self.world)
        return max(0, min(self.batch_size, per_rank - b * self.batch_size))

    def window_len(self, b: int, accum: int) -> int:
        """Samples in the accumulation window (optimizer step) that batch b belongs to."""
        first = b - b % accum
        return sum(self.batch_len(i) for i in range(first, min(first + accum, self.num_batches)))

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def indices(self) -> torch.Tensor:
        if self.train:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + self.epoch)
                order = torch.randperm(self.n, generator=gen)
            else:
                order = torch.arange(self.n)
            order = order[: self.n - self.n % self.world]
        else:
            padded = -(-self.n // self.world) * self.world
            order = torch.cat([torch.arange(self.n), torch.full((padded - self.n,), -1)])
        return order[self.rank :: self.world]

    def __len__(self) -> int:
        return self.num_batches - self.start_batch

    def __iter__(self) -> Iterator[list[int]]:
        mine = self.indices()
        for b in range(self.start_batch, self.num_batches):
            yield mine[b * self.batch_size : (b + 1) * self.batch_size].tolist()


class _ItemDataset(Dataset):
    """Per-item access for torch's DataLoader; index -1 is a padding sample."""

    def __init__(self, data: ImageSet):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if i < 0:
            return self.data.images[0], IGNORE_INDEX
        return self.data.images[i], int(self.data.labels[i])


class TorchLoader:
    """torch.utils.data.DataLoader driven by a ShardedOrder; batches are copied non-blocking."""

    def __init__(self, data: ImageSet, order: ShardedOrder, lc: DictConfig, device, seed: int):
        workers = lc.num_workers
        self.order, self.device = order, device
        self.loader = DataLoader(
            _ItemDataset(data),
            batch_sampler=order,
            num_workers=workers,
            pin_memory=lc.pin_memory and device.type == "cuda",
            persistent_workers=lc.persistent_workers and workers > 0,
            prefetch_factor=lc.prefetch_factor if workers > 0 else None,
            # Its own generator, so creating an iterator never draws from the global RNG
            # (that would make a mid-epoch resume diverge).
            generator=torch.Generator().manual_seed(seed),
        )

    def __len__(self) -> int:
        return len(self.order)

    def epoch(
        self, epoch: int, start_batch: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.order.set_epoch(epoch, start_batch)
        for images, labels in self.loader:
            yield (
                images.to(self.device, non_blocking=True),
                labels.to(self.device, non_blocking=True),
            )


class DeviceLoader:
    """The whole split as one uint8 tensor on the device; a batch is one index_select."""

    def __init__(self, data: ImageSet, order: ShardedOrder, device):
        self.order, self.device = order, device
        self.images = data.images.to(device)
        self.labels = data.labels.to(device)

    def __len__(self) -> int:
        return len(self.order)

    def epoch(
        self, epoch: int, start_batch: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.order.set_epoch(epoch, start_batch)
        idx = self.order.indices().to(self.device, non_blocking=True)
        bs = self.order.batch_size
        padded = not self.order.train and bool(self.order.n % self.order.world)
        for b in range(start_batch, self.order.num_batches):
            i = idx[b * bs : (b + 1) * bs]
            if padded:
                valid = i >= 0
                i = i.clamp(min=0)
                yield self.images[i], torch.where(valid, self.labels[i], IGNORE_INDEX)
            else:
                yield self.images[i], self.labels[i]


class BatchTransform:
    """uint8 batch on the device -> augmented, normalised float batch (one fused pass)."""

    def __init__(self, ds: DictConfig, device, dtype, channels_last: bool, seed: int, rank: int):
        c = ds.in_channels
        std = torch.tensor(list(ds.std), dtype=torch.float32).view(1, c, 1, 1)
        mean = torch.tensor(list(ds.mean), dtype=torch.float32).view(1, c, 1, 1)
        self.scale = (1.0 / (255.0 * std)).to(device)
        self.bias = (-mean / std).to(device)
        self.shift, self.hflip = ds.random_shift, ds.random_hflip
        self.dtype, self.channels_last, self.device = dtype, channels_last, device
        self.seed, self.rank = seed, rank

    def __call__(self, images: torch.Tensor, train: bool, epoch: int = 0, batch: int = 0):
        if train and (self.shift or self.hflip):
            # Seeded by position, not by a running RNG: resuming mid-epoch gives the same crops.
            gen = torch.Generator(self.device)
            gen.manual_seed(hash((self.seed, epoch, batch, self.rank)) & 0x7FFF_FFFF_FFFF)
            images = self._augment(images, gen)
        x = torch.addcmul(self.bias, images.float(), self.scale)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x.to(self.dtype)

    def _augment(self, images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        n, _, h, w = images.shape
        dev = images.device
        if self.shift:
            s = self.shift
            padded = F.pad(images, (s, s, s, s))
            dy = torch.randint(0, 2 * s + 1, (n, 1), generator=gen, device=dev)
            dx = torch.randint(0, 2 * s + 1, (n, 1), generator=gen, device=dev)
            rows = (dy + torch.arange(h, device=dev))[:, :, None]
            cols = (dx + torch.arange(w, device=dev))[:, None, :]
            batch = torch.arange(n, device=dev)[:, None, None]
            images = padded[batch, :, rows, cols].permute(0, 3, 1, 2)  # [N,H,W,C] -> [N,C,H,W]
        if self.hflip:
            flip = torch.rand(n, generator=gen, device=dev) < 0.5
            images = torch.where(flip[:, None, None, None], images.flip(3), images)
        return images


def dataset_nbytes(data: ImageSet) -> int:
    return data.images.numel() * data.images.element_size() + data.labels.numel() * 8


def build_loader(data, lc, *, train, device, seed, rank, world, limit):
    batch_size = lc.batch_size if train else (lc.eval_batch_size or lc.batch_size)
    order = ShardedOrder(
        len(data),
        batch_size,
        train=train,
        shuffle=lc.shuffle,
        seed=seed,
        rank=rank,
        world=world,
        drop_last=lc.drop_last,
        limit=limit,
    )
    if lc.name == "device":
        return DeviceLoader(data, order, device)
    return TorchLoader(data, order, lc, device, seed)
