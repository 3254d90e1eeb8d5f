"""The loaders. All draw their order from :class:`ShardedOrder` (data/orders.py), so for the
same seed they give the same batches, and all hand over the split's raw inputs (uint8 images for
the built-in sets); :class:`~accel_train.data.transform.BatchTransform` augments and normalises them
on the device, where it is cheap.

- ``loader=torch``: torch's DataLoader over any map-style split (workers, pinned memory, ...).
- ``loader=device``: the whole split as one tensor on the device; a batch is one index_select.
- ``loader=ray``: the same items and collate as ``loader=torch``, run by Ray actors on a
  cluster's CPU nodes (data/remote/ray_loader.py): for inputs one node's CPUs cannot keep up with.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from accel_train.data.batch import to_device
from accel_train.data.build import check_labels
from accel_train.data.orders import ShardedOrder
from accel_train.data.remote.ray_loader import RayLoader
from accel_train.data.splits import ImageSet
from accel_train.errors import UserError

# The label of padding samples in sharded evaluation: every rank runs the same number of
# batches (FSDP's forward is a collective), and the padding is sliced off before scoring.
IGNORE_INDEX = -100


class _Items(Dataset):
    """The split seen through (epoch, index) keys; index -1 is a padding sample. Labelled
    items (classification) are (input, int class), or (input, int class, group) where the
    evaluation scores a per-sample field apart (Splits.groups); other items pass as they are."""

    def __init__(self, split: Dataset, labelled: bool = True):
        self.split, self.labelled = split, labelled
        self.epoch_aware = callable(getattr(split, "getitem", None))

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, key: tuple[int, int]):
        epoch, i = key
        if i < 0:  # padding: sliced off by the evaluation (ShardedOrder.valid_len)
            first = self.split[0]
            return (first[0], IGNORE_INDEX, *first[2:]) if self.labelled else first
        item = self.split.getitem(i, epoch) if self.epoch_aware else self.split[i]
        if not self.labelled:
            return item
        x, y, *group = item
        return (x, int(y), *group)


class CheckedCollate:
    """The split's collate (default_collate unless it has a ``collate``), then the training
    labels checked on the host (in the worker, before any transfer): a label outside
    [0, num_classes) stops the run with a clear error instead of an index error (or a
    device-side assert on CUDA) inside the loss. The shard reader (data/shards/reader.py) checks
    its batches with it too."""

    def __init__(self, num_classes: int, collate=default_collate):
        self.num_classes, self.collate = num_classes, collate

    def __call__(self, items):
        images, labels, *group = self.collate(items)
        check_labels(labels, self.num_classes)
        return (images, labels, *group)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader worker_init_fn: a worker leaves SIGINT and SIGTERM to the trainer.

    Ctrl-C reaches the whole process group and SLURM/torchrun signal every process, so workers
    get the signal the trainer checkpoints on. A worker that died of it would fail the trainer's
    next batch ("DataLoader worker exited unexpectedly") before the checkpoint. Forked workers
    inherit the trainer's handler (which ignores signals in other processes); spawned or
    forkserver ones (Python 3.14's default on Linux) start with Python's defaults, hence this.
    The trainer shuts its workers down when it is done; if it is killed, torch's watchdog in
    each worker notices the parent is gone and exits."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


class TorchLoader:
    """torch.utils.data.DataLoader driven by a ShardedOrder; batches are copied non-blocking."""

    def __init__(
        self,
        split,
        order: ShardedOrder,
        loader_cfg: DictConfig,
        device,
        seed,
        num_classes,
        labelled: bool = True,
    ):
        workers = loader_cfg.num_workers
        self.order, self.device = order, device
        # A split whose items do not stack (dataset.decode=gpu: encoded bytes) brings its own.
        collate = getattr(split, "collate", None) or default_collate
        if order.train and labelled:
            collate = CheckedCollate(num_classes, collate)
        self.loader = DataLoader(
            _Items(split, labelled),
            batch_sampler=order,
            num_workers=workers,
            collate_fn=collate,
            pin_memory=loader_cfg.pin_memory and device.type == "cuda",
            persistent_workers=loader_cfg.persistent_workers and workers > 0,
            prefetch_factor=loader_cfg.prefetch_factor if workers > 0 else None,
            worker_init_fn=ignore_stop_signals,
            multiprocessing_context=loader_cfg.multiprocessing_context if workers > 0 else None,
            # Its own generator, so creating an iterator never draws from the global RNG
            # (that would make a mid-epoch resume diverge).
            generator=torch.Generator().manual_seed(seed),
        )

    def __len__(self) -> int:
        return len(self.order)

    def close(self) -> None:
        """Shut the workers down now. Persistent workers otherwise live as long as the
        DataLoader's iterator, which an exception's frames can keep until the interpreter
        exits; multiprocessing's exit hook would then SIGTERM them, which they ignore
        (ignore_stop_signals), and wait for ever."""
        iterator = getattr(self.loader, "_iterator", None)  # torch keeps persistent ones here
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.loader._iterator = None

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator:
        self.order.set_epoch(epoch, start_batch)
        for batch in self.loader:
            if isinstance(batch, list):  # default_collate makes lists of tuple items
                batch = tuple(batch)
            yield to_device(batch, self.device)  # pinned memory: asynchronous copies


class DeviceLoader:
    """The whole split as tensors on the device (an ImageSet's images and labels, or a
    TensorDataset's tensors); a batch is one index_select of each."""

    def __init__(self, data: ImageSet | TensorDataset, order: ShardedOrder, device):
        self.order, self.device = order, device
        if isinstance(data, ImageSet):
            self.tensors = (data.images.to(device), data.labels.to(device))
            self.labelled = True
        else:
            self.tensors = tuple(t.to(device) for t in data.tensors)
            self.labelled = False

    def __len__(self) -> int:
        return len(self.order)

    def close(self) -> None:
        pass  # nothing runs in the background

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, ...]]:
        self.order.set_epoch(epoch, start_batch)
        idx = self.order.indices().to(self.device, non_blocking=True)
        bs = self.order.batch_size
        padded = not self.order.train and bool(self.order.n % self.order.world)
        for b in range(start_batch, self.order.num_batches):
            i = idx[b * bs : (b + 1) * bs]
            if padded:
                valid = i >= 0
                i = i.clamp(min=0)
                if self.labelled:
                    images, labels = self.tensors
                    yield images[i], torch.where(valid, labels[i], IGNORE_INDEX)
                    continue
            yield tuple(t[i] for t in self.tensors)


def ray_loader(split, order, loader_cfg, device, rank, num_classes, labelled):
    """loader=ray: the same items and collate as TorchLoader's, made by Ray actors."""
    collate = getattr(split, "collate", None) or default_collate
    if order.train and labelled:
        collate = CheckedCollate(num_classes, collate)
    return RayLoader(split, _Items(split, labelled), collate, order, loader_cfg, device, rank)


def build_loader(
    split, loader_cfg, *, train, device, seed, rank, world, limit, num_classes, labelled=True
):
    own = getattr(split, "make_loader", None) if train else None
    if loader_cfg.name == "ray" and (own is not None or isinstance(split, IterableDataset)):
        raise UserError(
            f"loader=ray sends index lists to Ray workers that hold the split, and the "
            f"{type(split).__name__} split is read in an order of its own (an iterable or "
            "streaming data set: no index to send). Use `loader=torch` for it (a streaming "
            "set reads its shards in parallel itself)."
        )
    if own is not None:
        # A split that is read in an order of its own (a streaming data set reads chunk by
        # chunk) brings its loader, with the same interface: epoch(), order, close().
        return own(
            loader_cfg,
            device=device,
            seed=seed,
            rank=rank,
            world=world,
            limit=limit,
            num_classes=num_classes,
            labelled=labelled,
        )
    batch_size = (
        loader_cfg.batch_size if train else (loader_cfg.eval_batch_size or loader_cfg.batch_size)
    )
    order = ShardedOrder(
        len(split),
        batch_size,
        train=train,
        shuffle=loader_cfg.shuffle,
        seed=seed,
        rank=rank,
        world=world,
        drop_last=loader_cfg.drop_last,
        limit=limit,
    )
    if loader_cfg.name == "device":
        return DeviceLoader(split, order, device)
    if loader_cfg.name == "ray":
        return ray_loader(split, order, loader_cfg, device, rank, num_classes, labelled)
    return TorchLoader(split, order, loader_cfg, device, seed, num_classes, labelled)
