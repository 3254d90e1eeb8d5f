"""Data: the real torchvision loading of IDX MNIST, the missing-data error, and the two loaders
(`loader=torch`, `loader=device`) giving identical batches for the same seed, also sharded."""

from __future__ import annotations

import pytest
import torch
from helpers import MNIST_TEST, MNIST_TRAIN, make_digits
from omegaconf import OmegaConf

from accel_train.data.builtin import _load_torchvision, synthetic_digits, synthetic_splits
from accel_train.data.loaders import IGNORE_INDEX, build_loader
from accel_train.data.splits import ImageSet
from accel_train.errors import UserError

CPU = torch.device("cpu")


def test_mnist_idx_loads_through_torchvision(mnist_dir):
    for train, n, seed in ((True, MNIST_TRAIN, 1), (False, MNIST_TEST, 2)):
        split, classes = _load_torchvision("mnist", str(mnist_dir), download=False, train=train)
        images, labels = make_digits(n, seed)
        assert classes == 10
        assert split.images.shape == (n, 1, 28, 28) and split.images.dtype == torch.uint8
        assert split.labels.dtype == torch.int64
        assert torch.equal(split.images[:, 0], images)
        assert torch.equal(split.labels, labels.long())


def test_missing_mnist_names_the_folder_and_the_fixes(tmp_path):
    with pytest.raises(UserError) as err:
        _load_torchvision("mnist", str(tmp_path), download=False, train=True)
    msg = str(err.value)
    assert str((tmp_path / "MNIST").resolve()) in msg
    assert "paths.data_dir" in msg and "dataset=synthetic" in msg


def test_synthetic_is_deterministic_and_disjoint():
    a = synthetic_digits(1, 28, 10, n=64, seed=3, draw=1)
    b = synthetic_digits(1, 28, 10, n=64, seed=3, draw=1)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    test = synthetic_digits(1, 28, 10, n=32, seed=3, draw=2)
    assert len(a) == 64 and len(test) == 32
    assert not torch.equal(a.images[:32], test.images)
    other = synthetic_digits(1, 28, 10, n=64, seed=4, draw=1)
    assert not torch.equal(a.images, other.images)
    splits = synthetic_splits(num_train=64, num_test=32, val_fraction=0.25, seed=3)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (48, 16, 32)


# ---- loaders ---------------------------------------------------------------------------------

N = 203  # odd and not a multiple of the batch size: partial batches and padding happen


def _indexed_set(n: int = N) -> ImageSet:
    """Images that carry their own index in the first two pixels, so batches can be decoded."""
    gen = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 1, 4, 4), generator=gen, dtype=torch.uint8)
    idx = torch.arange(n)
    images[:, 0, 0, 0] = (idx // 256).to(torch.uint8)
    images[:, 0, 0, 1] = (idx % 256).to(torch.uint8)
    return ImageSet(images, idx % 10)


def _indices(images: torch.Tensor) -> list[int]:
    return (images[:, 0, 0, 0].long() * 256 + images[:, 0, 0, 1].long()).tolist()


_LOADER_CFGS = {}


def _loader_cfg(compose_cfg, name: str, **kw):
    """The composed `loader=<name>` group (composed once per name), with overrides."""
    if name not in _LOADER_CFGS:
        _LOADER_CFGS[name] = compose_cfg([f"loader={name}"]).loader
    return OmegaConf.merge(_LOADER_CFGS[name], kw)


def _batches(loader, epoch: int, start_batch: int = 0):
    return [(x.clone(), y.clone()) for x, y in loader.epoch(epoch, start_batch)]


def _build(compose_cfg, name, data, *, train, rank=0, world=1, limit=0, **kw):
    lc = _loader_cfg(compose_cfg, name, **kw)
    return build_loader(
        data,
        lc,
        train=train,
        device=CPU,
        seed=7,
        rank=rank,
        world=world,
        limit=limit,
        num_classes=10,
    )


def _assert_same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.dtype == xb.dtype == torch.uint8 and ya.dtype == yb.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_both_loaders_give_the_same_training_batches(compose_cfg, num_workers):
    data = _indexed_set()
    extra = {"batch_size": 16, "num_workers": num_workers}
    torch_loader = _build(compose_cfg, "torch", data, train=True, **extra)
    device_loader = _build(compose_cfg, "device", data, train=True, batch_size=16)
    epochs = []
    for epoch in (0, 1):
        a, b = _batches(torch_loader, epoch), _batches(device_loader, epoch)
        assert len(a) == len(torch_loader) == -(-N // 16)
        _assert_same(a, b)
        seen = [i for x, _ in a for i in _indices(x)]
        assert sorted(seen) == list(range(N))  # every sample once per epoch
        epochs.append(seen)
    assert epochs[0] != epochs[1], "the order should be reshuffled every epoch"
    # The same seed gives the same order in a fresh loader.
    again = _build(compose_cfg, "device", data, train=True, batch_size=16)
    _assert_same(_batches(again, 1), _batches(device_loader, 1))


def test_labels_follow_their_images(compose_cfg):
    data = _indexed_set()
    for name in ("torch", "device"):
        loader = _build(compose_cfg, name, data, train=True, batch_size=32)
        for x, y in loader.epoch(0):
            assert y.tolist() == [i % 10 for i in _indices(x)]


@pytest.mark.parametrize("name", ["torch", "device"])
def test_mid_epoch_start_continues_with_the_next_batch(compose_cfg, name):
    data = _indexed_set()
    loader = _build(compose_cfg, name, data, train=True, batch_size=16)
    full = _batches(loader, 3)
    fresh = _build(compose_cfg, name, data, train=True, batch_size=16)
    _assert_same(_batches(fresh, 3, start_batch=5), full[5:])


def test_drop_last_and_limit(compose_cfg):
    data = _indexed_set()
    for name in ("torch", "device"):
        dropped = _batches(_build(compose_cfg, name, data, train=True, drop_last=True), 0)
        assert len(dropped) == N // 64 and all(len(y) == 64 for _, y in dropped)
        limited = _build(compose_cfg, name, data, train=True, batch_size=16, limit=3)
        assert len(limited) == 3 and len(_batches(limited, 0)) == 3


def test_sharded_training_batches_match_across_loaders_and_world_sizes(compose_cfg):
    data = _indexed_set(N - 1)  # even, so world=2 keeps every sample
    single = _batches(_build(compose_cfg, "device", data, train=True, batch_size=32), 0)
    for epoch in (0, 1):
        per_rank = []
        for rank in (0, 1):
            kw = dict(train=True, rank=rank, world=2, batch_size=16)
            a = _batches(_build(compose_cfg, "torch", data, **kw), epoch)
            b = _batches(_build(compose_cfg, "device", data, **kw), epoch)
            _assert_same(a, b)
            per_rank.append(a)
        seen = [i for batches in per_rank for x, _ in batches for i in _indices(x)]
        assert sorted(seen) == list(range(N - 1)), "each sample on exactly one rank"
        if epoch == 0:
            # The union of the ranks' k-th batches is batch k of one process with the global
            # batch size: the world size does not change what the model sees per step.
            for k, (x_single, _) in enumerate(single):
                union = _indices(per_rank[0][k][0]) + _indices(per_rank[1][k][0])
                assert sorted(union) == sorted(_indices(x_single))


def test_sharded_validation_pads_and_counts_every_sample_once(compose_cfg):
    data = _indexed_set()  # 203 samples over 2 ranks: one padding sample
    valid_seen, padding = [], 0
    for rank in (0, 1):
        kw = dict(train=False, rank=rank, world=2, batch_size=16)
        a = _batches(_build(compose_cfg, "torch", data, **kw), 0)
        b = _batches(_build(compose_cfg, "device", data, **kw), 0)
        _assert_same(a, b)
        assert len(a) == len(b) == -(-102 // 16)  # both ranks run the same number of batches
        order = _build(compose_cfg, "torch", data, **kw).order
        for b, (x, y) in enumerate(a):
            keep = y != IGNORE_INDEX
            # The padding is a suffix of the batch, and the host knows its length.
            assert keep.tolist() == [True] * order.valid_len(b) + [False] * (
                len(y) - order.valid_len(b)
            )
            padding += int((~keep).sum())
            valid_seen += _indices(x[keep])
            assert y[keep].tolist() == [i % 10 for i in _indices(x[keep])]
    assert padding == 1
    assert sorted(valid_seen) == list(range(N)), "every validation sample exactly once"


def test_validation_is_in_order_and_not_shuffled(compose_cfg):
    data = _indexed_set()
    for name in ("torch", "device"):
        loader = _build(compose_cfg, name, data, train=False, eval_batch_size=50)
        batches = _batches(loader, 0)
        assert [len(y) for _, y in batches] == [50, 50, 50, 50, 3]
        assert [i for x, _ in batches for i in _indices(x)] == list(range(N))
