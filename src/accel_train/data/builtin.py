"""The built-in data sets as in-memory uint8 tensors: torchvision's MNIST family and CIFAR-10,
and synthetic digits generated from a seed. Validation is held out of the training split."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import struct
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
    if train_pool.images.shape[1:] != test.images.shape[1:]:
        folder = _folder(name, Path(data_dir).expanduser()).resolve()
        raise UserError(
            f"dataset={name}: the training images under {folder} are "
            f"{'x'.join(map(str, train_pool.images.shape[1:]))} but the test images "
            f"{'x'.join(map(str, test.images.shape[1:]))} (channels x height x width): the "
            f"files come from different data sets. Replace them with the originals.{_where_hint()}"
        )
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
    if len(val_idx) == 0 or len(train_idx) == 0:
        classes = len(pool.labels.unique())
        empty, left = (
            ("validation", "holds out no sample")
            if len(val_idx) == 0
            else (
                "training",
                "leaves no sample to train on",
            )
        )
        raise UserError(
            f"dataset.val_fraction={fraction} {left} of the {len(pool)} training samples (it "
            f"is rounded per class: {classes} classes of about {len(pool) // max(classes, 1)}), "
            f"so the {empty} split would be empty and its accuracy meaningless. Use e.g. "
            "`dataset.val_fraction=0.1`, more data, or `dataset.val_fraction=0` to validate on "
            "the test split."
        )
    return pool.subset(train_idx), pool.subset(val_idx)


# The files torchvision reads, per data set, under root/<folder>/: (train files, test files).
MNIST_FILES = (
    ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
)
CIFAR_FILES = (
    tuple(f"data_batch_{i}" for i in range(1, 6)) + ("batches.meta",),
    ("test_batch", "batches.meta"),
)

# Whose keys the messages name: accel-train's, or accel-eval's own (see `hints_for`).
_TOOL: contextvars.ContextVar[str] = contextvars.ContextVar("tool", default="accel-train")


@contextlib.contextmanager
def hints_for(tool: str):
    """Within this block data errors name the keys of `tool` ("accel-train", or "accel-eval" /
    "accel-export", which read a checkpoint's config and take `data_dir=`)."""
    token = _TOOL.set(tool)
    try:
        yield
    finally:
        _TOOL.reset(token)


def _folder(name: str, root: Path) -> Path:
    if name == "cifar10":
        return root / "cifar-10-batches-py"
    return root / TORCHVISION_SETS[name] / "raw"


def _files(name: str, root: Path, train: bool | None = None) -> list[Path]:
    """The files of one split (train True/False), or of both (None)."""
    table = CIFAR_FILES if name == "cifar10" else MNIST_FILES
    splits = (table[0], table[1]) if train is None else (table[0 if train else 1],)
    folder = _folder(name, root)
    return [folder / f for f in dict.fromkeys(f for split in splits for f in split)]


def _load_torchvision(name: str, data_dir: str, download: bool, train: bool):
    """One split of a torchvision data set as an ImageSet, and its number of classes.

    Absent files are downloaded (when allowed); files that are there but damaged are reported
    as what they are, naming the file, and never trained on."""
    import torchvision  # 3 s to import: only when a torchvision data set is used

    cls = getattr(torchvision.datasets, TORCHVISION_SETS[name])
    root = Path(data_dir).expanduser()
    # torchvision wants every file of the data set, both splits (CIFAR-10 its meta file too).
    missing = [f for f in _files(name, root) if not f.exists()]
    if missing and not _legacy_mnist(name, root):
        _download(cls, name, root, download, train, missing)
    if name == "cifar10":
        for f in _files(name, root, train):
            _check_readable(name, f)
    elif all(f.exists() for f in _files(name, root, train)):  # else: the legacy .pt files
        images_file, labels_file = _files(name, root, train)
        n_images, _ = _check_idx(name, images_file, ndim=3)
        n_labels, _ = _check_idx(name, labels_file, ndim=1)
        if n_images != n_labels:
            raise UserError(
                _bad(
                    name,
                    images_file,
                    f"holds {n_images} images but {labels_file.name} beside it holds {n_labels} "
                    "labels: the two files do not belong together",
                    both=True,
                )
            )
    try:
        tv = cls(root=str(root), train=train, download=False)
    except Exception as err:  # the checks above name the usual causes; this is the rest
        raise UserError(_unreadable(name, root, train, err)) from None
    if name == "cifar10":
        images = torch.from_numpy(tv.data).permute(0, 3, 1, 2).contiguous()
        labels = torch.tensor(tv.targets, dtype=torch.int64)
    else:
        images = tv.data.unsqueeze(1).contiguous()
        labels = tv.targets.to(torch.int64)
    classes = len(tv.classes)
    bad = ((labels < 0) | (labels >= classes)).nonzero().flatten()
    if len(bad):
        # CIFAR-10 keeps images and labels together in several batch files: name the folder.
        where = _folder(name, root) if name == "cifar10" else _files(name, root, train)[1]
        i = int(bad[0])
        raise UserError(
            _bad(
                name,
                where,
                f"holds label {int(labels[i])} (sample {i}"
                + (f", and {len(bad) - 1} more outside the range" if len(bad) > 1 else "")
                + f") but {name} has {classes} classes, labels 0-{classes - 1}",
            )
        )
    return ImageSet(images, labels), classes


def _legacy_mnist(name: str, root: Path) -> bool:
    """Old torchvision versions stored MNIST as processed/training.pt and test.pt."""
    processed = root / TORCHVISION_SETS[name] / "processed"
    return name != "cifar10" and all((processed / f).is_file() for f in ("training.pt", "test.pt"))


def _download(cls, name: str, root: Path, download: bool, train: bool, missing: list[Path]):
    if not download:
        reason = "dataset.download=false"
        if _TOOL.get() != "accel-train":
            reason += " in the checkpoint's config"
        raise UserError(_missing_message(name, root, reason, missing))
    try:
        cls(root=str(root), train=train, download=True)
    except Exception as err:  # torchvision raises several types for network failures
        still = [f for f in _files(name, root) if not f.exists()]
        if not still:  # downloaded, then not readable: report that, not a failed download
            raise UserError(_unreadable(name, root, train, err)) from None
        # torchvision's message: "Error downloading <file>:" ... "<the cause>" on its last line.
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [""]
        cause = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
        reason = f"the download failed ({type(err).__name__}: {cause[:300]})"
        raise UserError(_missing_message(name, root, reason, still)) from None


def _read_head(name: str, path: Path, n: int) -> tuple[bytes, int]:
    """The first n bytes and the size of a data file; unreadable files named as such."""
    try:
        with open(path, "rb") as f:
            return f.read(n), os.fstat(f.fileno()).st_size
    except IsADirectoryError:
        raise UserError(_bad(name, path, "is a directory, not a data file")) from None
    except PermissionError:
        raise UserError(
            _bad(
                name,
                path,
                "is not readable: permission denied for this user. Fix the file's permissions "
                f"(e.g. `chmod a+r {path}`)",
                replace=False,
            )
        ) from None
    except OSError as err:
        raise UserError(
            _bad(name, path, f"cannot be read ({err.strerror or err})", replace=False)
        ) from None


def _check_readable(name: str, path: Path) -> None:
    _read_head(name, path, 1)


def _check_idx(name: str, path: Path, ndim: int) -> tuple[int, tuple[int, ...]]:
    """Check an IDX file of unsigned bytes against its header without loading it: the magic
    number, the dimensions and the size. Returns (items, dims).

    Long because it is a linear list of the header's checks, each with its own message."""
    kind = "images" if ndim == 3 else "labels"
    expected_magic = bytes([0, 0, 0x08, ndim])
    head, size = _read_head(name, path, 4 + 4 * ndim)
    if head[:2] == b"\x1f\x8b":
        raise UserError(
            _bad(
                name,
                path,
                "is gzip-compressed: torchvision reads the extracted file. Extract it in place "
                f"(`gunzip -k {path}.gz`, or rename it to {path.name}.gz and gunzip it)",
                replace=False,
            )
        )
    if len(head) < 4 or head[:2] != b"\x00\x00" or head[2] != 0x08:
        found = " ".join(f"{b:02x}" for b in head[:4]) or "nothing (an empty file)"
        raise UserError(
            _bad(
                name,
                path,
                f"is not an IDX file of {kind}: it starts with {found}, where an IDX file of "
                f"unsigned bytes with {ndim} dimension(s) starts with "
                f"{' '.join(f'{b:02x}' for b in expected_magic)} (the magic number)",
            )
        )
    if head[3] != ndim:
        other = "labels" if head[3] == 1 else "images" if head[3] == 3 else "other data"
        raise UserError(
            _bad(
                name,
                path,
                f"holds {head[3]}-dimensional data ({other}?) where the {kind} ({ndim} "
                "dimension(s)) belong: are the images and labels files swapped?",
            )
        )
    header = 4 + 4 * ndim
    if len(head) < header:
        raise UserError(
            _bad(name, path, f"is truncated: {size} bytes, shorter than its own IDX header")
        )
    dims = struct.unpack(f">{ndim}I", head[4:header])
    want = header + math.prod(dims)
    shape = " x ".join(map(str, dims))
    if size < want:
        raise UserError(
            _bad(
                name,
                path,
                f"is truncated: its header announces {shape} bytes of {kind} ({want:,} bytes "
                f"with the header) but the file has {size:,} (a partial download or copy?)",
            )
        )
    if size > want:
        raise UserError(
            _bad(
                name,
                path,
                f"is {size - want:,} bytes longer than its header announces ({shape} {kind}): "
                "corrupt, or not an MNIST-format file",
            )
        )
    if dims[0] == 0:
        raise UserError(_bad(name, path, f"holds no {kind} (its header says 0)"))
    if ndim == 3 and dims[1] != dims[2]:
        raise UserError(
            _bad(name, path, f"holds {dims[1]}x{dims[2]} images; the models expect square ones")
        )
    return dims[0], dims


def _bad(name: str, path: Path, what: str, replace: bool = True, both: bool = False) -> str:
    """A damaged data file: what is wrong with it, and what to do."""
    it = "them" if both else "it"
    what_to = "both with the originals" if both else "it with the original"
    fix = (
        f" Replace {what_to}: delete {it} (torchvision downloads what is missing when "
        f"dataset.download=true) or copy {it} again."
        if replace
        else ""
    )
    if not what.endswith((".", "?")):
        what += "."
    kind = "folder" if path.is_dir() and path.name == "cifar-10-batches-py" else "file"
    return f"dataset={name}: the data {kind} {path.resolve()} {what}{fix}{_where_hint()}"


def _unreadable(name: str, root: Path, train: bool, err: Exception) -> str:
    folder = _folder(name, root).resolve()
    detail = " ".join(str(err).split())[:300]
    if name == "cifar10":
        bad = _cifar_corrupt(root, train)
        if bad:
            return _bad(
                name,
                bad[0],
                "is corrupt or not the official file (its MD5 checksum does not match)"
                + (f"; so are {', '.join(p.name for p in bad[1:])}" if bad[1:] else ""),
            )
    return (
        f"dataset={name}: the files under {folder} are there but could not be read "
        f"({type(err).__name__}: {detail}). Replace them with the originals.{_where_hint()}"
    )


def _cifar_corrupt(root: Path, train: bool) -> list[Path]:
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import check_integrity

    folder = _folder("cifar10", root)
    listed = (CIFAR10.train_list if train else CIFAR10.test_list) + [
        [CIFAR10.meta["filename"], CIFAR10.meta["md5"]]
    ]
    return [folder / f for f, md5 in listed if not check_integrity(str(folder / f), md5)]


def _where_hint() -> str:
    if _TOOL.get() != "accel-train":
        return (
            f" ({_TOOL.get()} reads the data from the checkpoint's paths.data_dir unless "
            "`data_dir=...` is given.)"
        )
    return ""


def _missing_message(name: str, root: Path, reason: str, missing: list[Path] = ()) -> str:
    folder = _folder(name, root)
    names = [f.name for f in missing]
    if not names:
        what = "the files are"
    elif len(names) == 1:
        what = f"{names[0]} is"
    else:
        what = f"{', '.join(names[:-1])} and {names[-1]} are"
    broken = [f for f in missing if f.is_symlink()]
    if broken:
        what += f" (a broken symbolic link: {broken[0].name} -> {os.readlink(broken[0])})"
    if _TOOL.get() != "accel-train":
        fix = (
            "Put the files there, or point `data_dir=...` at the folder that holds them now "
            f"({_TOOL.get()} reads the data from the checkpoint's paths.data_dir by default)."
        )
    else:
        fix = (
            "Put the files there (torchvision's layout), point `paths.data_dir=...` (or "
            "$ACCEL_TRAIN_DATA_DIR) at the folder that holds them, or train offline with "
            "`dataset=synthetic`."
        )
    return f"dataset={name}: {what} not under {folder.resolve()} and {reason}. {fix}"


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
    # Each image rolled by its (dy, dx), as torch.roll would, in two gathers instead of one
    # roll per image (the same images, a tenth of the time: a fast_dev_run makes 2560).
    pos = torch.arange(size)
    rows = (pos - shifts[:, :1]) % size  # (n, size): the source row of each row
    cols = (pos - shifts[:, 1:]) % size
    images = images.gather(2, rows[:, None, :, None].expand(images.shape))
    images = images.gather(3, cols[:, None, None, :].expand(images.shape))
    images = images * torch.empty(n, 1, 1, 1).uniform_(0.6, 1.0, generator=gen)
    images = images + 0.25 * torch.randn(images.shape, generator=gen)
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    return ImageSet(images, labels)
