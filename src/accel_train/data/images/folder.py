"""`dataset=image_folder`: image files in torchvision's ImageFolder layout.

    <root>/<train_split>/<class>/*.jpg|png|webp|...   training images
    <root>/<val_split>/<class>/...     validation images (ImageNet's, imagenette's `val/`)
    <root>/<test_split>/<class>/...    optional test split

Without a val_split folder (or with ``holdout``), validation is a held-out ``val_fraction`` of
the training folder: data/folder_tree.py has the rule and the folder scan.

Every file's header is checked first (``check_images``: unreadable, CMYK, transparent and
grayscale files are refused, naming them and the fix, before anything is trained or written).

Without a cache (the default) every sample is decoded from the whole photo, as torchvision and
timm read ImageNet (data/images/folder_uncached.py, data/images/decode.py): training takes a random
resized crop of the whole image (area share ``crop_scale``, default (0.08, 1)) resized to
``image_size`` and a flip, seeded by (seed, index, epoch) so the batches do not depend on the number
of workers or on a resume; evaluation resizes the shorter side to ``eval_image_size / crop_pct`` and
takes the center ``eval_image_size`` crop. ``decode=gpu`` hands the JPEG bytes to the device, which
decodes them with nvJPEG and crops there.

``cache=ram|disk`` (and ``augment=device``) read *base* images instead: each file decoded once,
its shorter side resized to L (``resize_size``, default ``eval_image_size / crop_pct``) and
center-cropped to a fixed-size uint8 ``[3, L, L]``, kept in one ``[N, 3, L, L]`` tensor (a
memory-mapped file under ``cache_dir`` for ``disk``, reused by later runs). Evaluation items are
the center crop of the base; training items depend on ``augment``: ``cpu`` = the random resized
crop of the base plus a flip in the loader worker; ``device`` = the base image itself, cropped
and flipped batch-wise on the device by :class:`DeviceRandomResizedCrop`; ``none`` = the center
crop. Items read from a cache are bit-identical to decoding. The random crop then never sees
the photo's edges beyond the base square: the trade is worth it for small images re-read for
many epochs (decoding dominates, docs/vision.md). torchvision is imported only where base
images are decoded: it costs seconds at start-up.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import re
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from accel_train.data.crops import (
    INTERPOLATIONS,
    DeviceRandomResizedCrop,
    RandomResizedCrop,
    center_crop,
    eval_resize_to,
    resize,
    view_of,
)
from accel_train.data.folder_tree import Folder, plan_layout, scan_folder
from accel_train.data.images.decode import UnreadableImageError, unreadable
from accel_train.data.images.decode import check_images as check_headers
from accel_train.data.images.folder_uncached import Files, PhotoSplit
from accel_train.data.images.sample_recipe import hooked_crop
from accel_train.data.splits import ImageSet, Splits
from accel_train.errors import UserError

log = logging.getLogger(__name__)

AUGMENTS = ("cpu", "device", "none")
CACHES = ("none", "ram", "disk")
DECODES = ("cpu", "gpu")
# Part of the disk cache key: bump it when the base image computation changes.
CACHE_FORMAT = 1
# Building a cache decodes in this many DataLoader worker processes; folders smaller than
# PARALLEL_DECODE_MIN images are decoded in-process (starting workers would cost more).
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
DECODE_WORKERS = min(4, _CPUS or 1)
PARALLEL_DECODE_MIN = 512
DECODE_BATCH = 64

# The error lives in data/images/decode.py, the folder scan in data/folder_tree.py.
__all__ = ["UnreadableImageError", "build_image_folder", "scan_folder"]


# ---- the builder ---------------------------------------------------------------------------


def build_image_folder(
    *,
    root: str,
    train_split: str = "train",
    val_split: str | None = "val",
    test_split: str | None = "test",
    holdout: bool = False,
    val_fraction: float = 0.1,
    seed: int = 0,
    image_size: int = 64,
    eval_image_size: int | None = None,
    crop_pct: float = 0.875,
    interpolation: str = "bilinear",
    resize_size: int = 0,
    augment: str = "cpu",
    crop_scale: Sequence[float] = (0.08, 1.0),
    random_hflip: bool = True,
    cache: str = "none",
    cache_dir: str | None = None,
    decode: str = "cpu",
    check_images: bool = True,
) -> Splits:
    """Train / val / test splits of an ImageFolder tree (see the module docstring): val is
    the ``val_split`` folder, or a stratified, seeded ``val_fraction`` of the train folder
    without one or with ``holdout`` (data/folder_tree.py's rule); test the ``test_split``
    folder (None when it is null or absent).

    Long because its signature lists every key of the option, one a line (the builder's
    keyword arguments)."""
    scale = check_options(
        image_size, resize_size, augment, cache, val_fraction, crop_scale,
        eval_image_size=eval_image_size, crop_pct=crop_pct, interpolation=interpolation,
        decode=decode,
    )  # fmt: skip
    size, eval_size = int(image_size), int(eval_image_size or image_size)
    resize_to = int(resize_size) or eval_resize_to(eval_size, crop_pct)
    layout = _layout(root, train_split, val_split, test_split, holdout, val_fraction)
    train_folder = layout.train
    if check_images:
        folders = [f for f in (train_folder, layout.val, layout.test) if f is not None]
        paths = [str(f.path / rel) for f in folders for rel in f.files]
        check_headers(paths, jpeg_only=decode == "gpu", log=log)
    train_idx, val_idx = layout.indices(val_fraction, seed)
    args = (size, eval_size, resize_to, scale, random_hflip, augment, seed, interpolation)
    if cache == "none" and augment != "device":
        make = _photo_splits(*args, decode)
    else:
        make = _base_splits(*args, cache, Path(cache_dir).expanduser() if cache_dir else None)

    def whole(folder):  # every image of a folder, as an evaluation split
        return make(folder, torch.arange(len(folder.files)))[1] if folder else None

    empty = torch.arange(0)  # (validation is the val folder: none held out of train/)
    train, val = make(train_folder, train_idx, val_idx if val_idx is not None else empty)
    val = val if val_idx is not None else whole(layout.val)
    test = whole(layout.test)
    device_augment = (
        DeviceRandomResizedCrop(size, scale, random_hflip) if augment == "device" else None
    )
    return Splits(
        train,
        val,
        test,
        in_channels=3,
        image_size=size,
        num_classes=len(train_folder.classes),
        device_augment=device_augment,
        class_names=list(train_folder.classes),
    )


def _layout(root: str, train_split, val_split, test_split, holdout, val_fraction):
    """The tree's layout (data/folder_tree.py), every folder scanned before anything is decoded:
    a layout error should not wait for a cache."""
    root_dir = Path(root).expanduser()
    if not root_dir.is_dir():
        raise UserError(
            f"dataset.root={root!r}: no such folder. Point `dataset.root=/path/to/data` at the "
            f"folder that holds `{train_split}/<class>/*.jpg` (torchvision's ImageFolder layout)."
        )
    return plan_layout(root_dir, train_split, val_split, test_split, holdout, val_fraction)


def _photo_splits(size, eval_size, resize_to, scale, hflip, augment, seed, mode, decode):
    """folder, train indices[, val indices] -> (train split or None, val/test split): the
    full-size photo splits (data/images/folder_uncached.py)."""
    crop = RandomResizedCrop(size, scale, hflip, mode) if augment == "cpu" else None

    def make(folder: Folder, first: torch.Tensor, held: torch.Tensor | None = None):
        files, labels = Files(folder.path, folder.files), folder.labels
        common = dict(seed=seed, mode=mode, decode=decode)
        evaluated = PhotoSplit(files, first if held is None else held, labels,
                               size=eval_size, resize_to=resize_to, **common)  # fmt: skip
        if held is None:
            return None, evaluated
        # augment=none: the evaluation transform at the training size
        train_resize = resize_to if size == eval_size else round(resize_to * size / eval_size)
        train = PhotoSplit(files, first, labels, size=size, resize_to=train_resize, crop=crop,
                           **common)  # fmt: skip
        return train, evaluated

    return make


def _base_splits(size, eval_size, resize_to, scale, hflip, augment, seed, mode, cache, cache_dir):
    """The same as :func:`_photo_splits` from base images (cache=ram|disk, augment=device)."""
    crop = RandomResizedCrop(size, scale, hflip, mode) if augment == "cpu" else None
    train_view = {"cpu": "random", "device": "base", "none": "center"}[augment]

    def make(folder: Folder, first: torch.Tensor, held: torch.Tensor | None = None):
        where = cache_dir or folder.path.parent / ".accel_cache"
        bases = BaseImages.load(folder, resize_to, cache, where)
        labels = folder.labels
        evaluated = make_split(bases, first if held is None else held, labels, "center", eval_size)
        if held is None:
            return None, evaluated
        return make_split(bases, first, labels, train_view, size, crop, seed), evaluated

    return make


def check_options(
    image_size, resize_size, augment, cache, val_fraction, crop_scale, *,
    eval_image_size=None, crop_pct=0.875, interpolation="bilinear", decode="cpu",
):  # fmt: skip
    """The crop scale range as two floats, after checking every option a user can get wrong:
    one check for `dataset=image_folder` and `dataset=streaming` (data/images/streaming.py)."""
    if image_size < 1 or (eval_image_size is not None and eval_image_size < 1):
        key, value = (
            ("image_size", image_size) if image_size < 1 else ("eval_image_size", eval_image_size)
        )
        raise UserError(
            f"dataset.{key}={value} must be >= 1: it is the side in pixels of the square "
            "images the model sees (eval_image_size: in evaluation; null = image_size), e.g. "
            f"`dataset.{key}=224`."
        )
    eval_size = eval_image_size or image_size
    if resize_size and resize_size < eval_size:
        raise UserError(
            f"dataset.resize_size={resize_size} is smaller than the evaluation size {eval_size}: "
            "images are resized to resize_size, then center-cropped. Set "
            "`dataset.resize_size=0` (= eval_image_size / crop_pct) or a value >= it."
        )
    _check_choices(augment, cache, crop_pct, interpolation, decode)
    if not 0 <= val_fraction < 1:
        raise UserError(
            f"dataset.val_fraction={val_fraction} must be in [0, 1): the share of the training "
            "folder held out for validation, e.g. `dataset.val_fraction=0.1`."
        )
    lo, hi = (float(x) for x in crop_scale) if len(crop_scale) == 2 else (0.0, -1.0)
    if not 0 < lo <= hi <= 1:
        raise UserError(
            f"dataset.crop_scale={list(crop_scale)} must be two numbers 0 < min <= max <= 1: "
            "the range of the random crop's area as a share of the image, e.g. "
            "`dataset.crop_scale=[0.08,1.0]` (torchvision's and timm's)."
        )
    return lo, hi


def _check_choices(augment, cache, crop_pct, interpolation, decode) -> None:
    if not 0 < crop_pct <= 1:
        raise UserError(
            f"dataset.crop_pct={crop_pct} must be in (0, 1]: evaluation resizes the shorter "
            "side to eval_image_size / crop_pct, then center-crops (timm's crop_pct; ImageNet's "
            "usual 0.875 turns 224 into 256). Set e.g. `dataset.crop_pct=0.875`."
        )
    for key, value, allowed, why in (
        ("interpolation", interpolation, INTERPOLATIONS, "the resize kernel, antialiased"),
        ("augment", augment, AUGMENTS, "`cpu` crops and flips in the loader workers, "
         "`device` on the device batch-wise (from cached base images), `none` only "
         "center-crops"),
        ("cache", cache, CACHES, "`none` decodes every image every epoch, `ram` decodes base "
         "images once into memory, `disk` into a memory-mapped file reused by later runs"),
        ("decode", decode, DECODES, "`cpu` decodes in the loader workers, `gpu` on the CUDA "
         "device with nvJPEG"),
    ):  # fmt: skip
        if value not in allowed:
            raise UserError(
                f"dataset.{key}={value!r} is not one of {', '.join(allowed)}: {why}. Set e.g. "
                f"`dataset.{key}={allowed[0]}`."
            )
    if decode == "gpu" and (cache != "none" or augment == "device"):
        raise UserError(
            f"dataset.decode=gpu decodes each JPEG on the device with its crop, and "
            f"dataset.{'cache=' + cache if cache != 'none' else 'augment=device'} reads decoded "
            "base images instead. Use one: `dataset.cache=none dataset.augment=cpu` with "
            "decode=gpu, or `dataset.decode=cpu`."
        )


# ---- base images: decoded on demand or read from a cache -----------------------------------


def load_base_image(path: str, size: int) -> torch.Tensor:
    """uint8 [3, size, size]: the file decoded to RGB, its shorter side resized to ``size``
    (antialiased bilinear, like torchvision's ``resize``), center-cropped."""
    from torchvision.io import read_file

    try:
        data = read_file(path)
    except (RuntimeError, OSError) as err:
        raise _unreadable(err, f"dataset.root: the image file {path}") from err
    return decode_base_image(data, size, f"dataset.root: the image file {path}")


def decode_base_image(data: torch.Tensor, size: int, what: str) -> torch.Tensor:
    """:func:`load_base_image` of an encoded file's bytes (uint8 [N]) already in memory, e.g.
    read from a shard (data/images/streaming.py); ``what`` names the file in the error."""
    from torchvision.io import ImageReadMode, decode_image

    try:
        img = decode_image(data, mode=ImageReadMode.RGB)
    except (RuntimeError, OSError) as err:
        img = _pil_decode(data)  # formats torchvision.io does not read (BMP, TIFF, PPM)
        if img is None:
            raise _unreadable(err, what) from err
    if img.dtype != torch.uint8:  # 16-bit PNGs: keep the high byte, as torchvision's to_dtype
        img = (img.to(torch.int32) >> 8).to(torch.uint8)
    h, w = img.shape[-2:]
    # torchvision's size rule: the shorter side becomes `size`, the longer one is truncated.
    new_h, new_w = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    if (new_h, new_w) != (h, w):
        img = resize(img, new_h, new_w)
    return center_crop(img, size).contiguous()


def _pil_decode(data: torch.Tensor) -> torch.Tensor | None:
    """uint8 [3, H, W] of an image PIL reads (None: PIL cannot read it either)."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as im:
            rgb = np.asarray(im.convert("RGB"))
    except (OSError, SyntaxError, ValueError):
        return None
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1)


_unreadable = unreadable  # (its old name)


class BaseImages:
    """The base image of every file of one folder, by index: decoded on demand, or a view of
    one cache tensor uint8 [N, 3, L, L] (in RAM or a memory-mapped file)."""

    def __init__(self, folder: Path, files: list[str], size: int, cache_file: Path | None = None):
        self.folder, self.size = str(folder), size
        # One numpy bytes array rather than a list of str: DataLoader workers are forked, and
        # reading Python objects touches their refcounts, copying the pages into every worker.
        self._files = np.array([os.fsencode(f) for f in files])
        self.cache_file = cache_file
        self.cache: torch.Tensor | None = None
        if cache_file is not None:
            self.cache = _map_cache(cache_file, len(files), size)

    @classmethod
    def load(cls, folder: Folder, size: int, cache: str, cache_dir: Path) -> BaseImages:
        """The folder's base images with the given ``dataset.cache`` mode (building the cache
        if it is missing or stale)."""
        if cache == "none":
            return cls(folder.path, folder.files, size)
        if cache == "ram":
            bases = cls(folder.path, folder.files, size)
            images = torch.empty(len(bases), 3, size, size, dtype=torch.uint8)
            start = 0
            for batch in bases.decode_all():
                images[start : start + len(batch)] = batch
                start += len(batch)
            bases.cache = images
            return bases
        path = cache_dir / cache_file_name(folder, size)
        if path.is_file() and path.stat().st_size == len(folder.files) * 3 * size * size:
            log.info("dataset.cache=disk: reusing %s", path)
        else:
            _write_cache(path, cls(folder.path, folder.files, size))
        return cls(folder.path, folder.files, size, cache_file=path)

    def __len__(self) -> int:
        return len(self._files)

    def path(self, j: int) -> str:
        return os.path.join(self.folder, os.fsdecode(self._files[j]))

    def __getitem__(self, j: int) -> torch.Tensor:
        if self.cache is not None:
            return self.cache[j]
        return load_base_image(self.path(j), self.size)

    def decode_all(self) -> Iterator[torch.Tensor]:
        """Every base image in file order, decoded (never from the cache), in uint8 batches
        [B, 3, L, L]; large folders by DECODE_WORKERS processes."""
        from torch.utils.data import DataLoader

        workers = DECODE_WORKERS if len(self) >= PARALLEL_DECODE_MIN else 0
        # Its own generator: a DataLoader iterator otherwise draws its base seed from the global
        # RNG, and building a cache would change the model's initial weights.
        loader = DataLoader(
            _Decoder(self),
            batch_size=DECODE_BATCH,
            num_workers=workers,
            generator=torch.Generator().manual_seed(0),
        )
        yield from loader

    def __getstate__(self) -> dict:
        # A memory-mapped cache is re-opened by a process that unpickles this (spawned
        # workers) instead of copying its bytes through the pipe.
        state = dict(self.__dict__)
        if self.cache_file is not None:
            state["cache"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.cache_file is not None:
            self.cache = _map_cache(self.cache_file, len(self._files), self.size)


class _Decoder(Dataset):
    """Decodes, whether or not ``bases`` has a cache (building one)."""

    def __init__(self, bases: BaseImages):
        self.bases = bases

    def __len__(self) -> int:
        return len(self.bases)

    def __getitem__(self, j: int) -> torch.Tensor:
        return load_base_image(self.bases.path(j), self.bases.size)


def cache_file_name(folder: Folder, size: int) -> str:
    """``<split>-<folder hash>-<L>px-<content hash>.u8``: the content hash covers the sorted
    relative paths, sizes and mtimes of the files (and the decoder's version), so adding,
    removing or rewriting any image gives a new name."""
    import torchvision  # the decoder's version: another libjpeg may decode differently

    where = hashlib.sha256(str(folder.path.resolve()).encode()).hexdigest()[:8]
    h = hashlib.sha256(f"{CACHE_FORMAT} {torchvision.__version__} {size}\n".encode())
    for rel in folder.files:
        st = os.stat(folder.path / rel)
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    split = re.sub(r"[^A-Za-z0-9_.-]+", "_", folder.path.name)
    return f"{split}-{where}-{size}px-{h.hexdigest()[:16]}.u8"


def _write_cache(path: Path, bases: BaseImages) -> None:
    """Decode every image into ``path`` atomically: a temporary file in the same folder,
    fsynced, then renamed over ``path``, so a killed build leaves no torn cache (at most a
    ``*.tmp`` file). Older caches of the same folder and size are removed."""
    log.info("dataset.cache=disk: decoding %d images of %s into %s", len(bases), bases.folder, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Not mkstemp: its files are private (0600), and a cache may be shared. The umask
        # applies as to any file the user writes.
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as err:
        raise _unwritable(path, err) from None
    try:
        with os.fdopen(fd, "wb") as f:
            for batch in bases.decode_all():
                f.write(batch.numpy().data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):  # reading images raises UnreadableImageError instead
            raise _unwritable(path, err) from None
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    prefix = path.name.rsplit("-", 1)[0] + "-"
    for old in path.parent.glob(f"{glob.escape(prefix)}*.u8"):
        if old != path:
            with contextlib.suppress(OSError):
                old.unlink()


def _unwritable(path: Path, err: OSError) -> UserError:
    return UserError(
        f"dataset.cache_dir={str(path.parent)!r}: cannot write the image cache there "
        f"({err.strerror or err}). Set `dataset.cache_dir=<a writable folder with room for "
        "it>` or use `dataset.cache=ram`."
    )


def _map_cache(path: Path, n: int, size: int) -> torch.Tensor:
    # shared=False maps the file copy-on-write: pages are read lazily and shared through the
    # page cache by every process, and nothing can write to the cache by accident.
    flat = torch.from_file(str(path), shared=False, size=n * 3 * size * size, dtype=torch.uint8)
    return flat.view(n, 3, size, size)


# ---- the splits ----------------------------------------------------------------------------


class ImageFolderSplit(Dataset):
    """Items ``(uint8 [3, s, s], label)`` of some of a folder's images.

    ``view``: ``center`` = the center S x S crop of the base image, ``random`` = a
    :class:`RandomResizedCrop` seeded by (seed, index, epoch), ``base`` = the L x L base image
    (cropped later by :class:`DeviceRandomResizedCrop`)."""

    def __init__(
        self,
        bases: BaseImages,
        indices: torch.Tensor,
        all_labels: torch.Tensor,
        view: str,
        size: int,
        crop: RandomResizedCrop | None = None,
        seed: int = 0,
    ):
        self.bases, self.indices, self.view, self.size = bases, indices, view, size
        self.crop, self.seed = crop, seed
        self.labels = all_labels[indices]  # int64 [N]: the labels without reading any image
        # data/images/folder_uncached.py's per-sample hooks, read with view="random"
        # (data/images/sample_recipe.py sets them).
        self.size_at = self.sample_augment = None

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.getitem(i, 0)

    def path(self, i: int) -> str:
        """Item i's source file (accel-eval's predictions name it)."""
        return self.bases.path(int(self.indices[i]))

    def getitem(self, i: int, epoch: int) -> tuple[torch.Tensor, int]:
        base = self.bases[int(self.indices[i])]
        draw = f"{self.seed}/{epoch}/{i}"
        if self.view == "random" and (self.size_at or self.sample_augment):
            return hooked_crop(self, base, draw, epoch), int(self.labels[i])
        image = view_of(base, self.view, self.crop, self.size, draw)
        return image, int(self.labels[i])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} images of {self.bases.folder}, {self.view})"


class CachedImageFolderSplit(ImageFolderSplit, ImageSet):
    """A split read from a cache whose items do not change between epochs (no CPU
    augmentation): also an :class:`ImageSet`, whose ``images`` ``loader=device`` holds on the
    device whole."""

    @property
    def images(self) -> torch.Tensor:
        """uint8 [N, 3, s, s] with ``images[i]`` = item i's image: a copy (read it once)."""
        cache = self.bases.cache
        if self.view == "center":
            cache = center_crop(cache, self.size)
        return cache[self.indices]

    def nbytes(self) -> int:
        side = self.bases.size if self.view == "base" else self.size
        return len(self) * (3 * side * side + 8)


def make_split(
    bases: BaseImages,
    indices: torch.Tensor,
    labels: torch.Tensor,
    view: str,
    size: int,
    crop: RandomResizedCrop | None = None,
    seed: int = 0,
):
    """An :class:`ImageFolderSplit`, a :class:`CachedImageFolderSplit` when it can be one."""
    held = bases.cache is not None and view != "random"
    cls = CachedImageFolderSplit if held else ImageFolderSplit
    return cls(bases, indices, labels, view, size, crop, seed)
