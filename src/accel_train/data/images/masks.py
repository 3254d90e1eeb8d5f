"""`dataset=mask_folder`: 2-D segmentation from image files and their label maps.

The layout, per split (`train`, and `val` when there is one):

    <root>/<split>/images/<stem>.png|jpg|jpeg   the images (RGB; grayscale is turned to RGB)
    <root>/<split>/masks/<stem>.png             the label maps: one class index per pixel

Without `<root>/val/`, a seeded `dataset.val_fraction` of the training pairs is held out
(data/splits.py's held_out_indices). Before anything is trained or written every pair is
checked: a mask missing for an image, a mask whose size differs from its image, and label
values >= the classes (`dataset.num_classes`, or the length of `dataset.classes`; unset: the
largest value seen + 1) are refused, naming the file.

Images are decoded per item by the image pipeline's decode (data/images/decode.py: PIL's lazy
open, the same refusals of a corrupt file), masks by PIL as they are (mode L or P: the palette
index is the class). A training item is one random `dataset.crop_size` crop of the pair, the
same box for image and mask (a pure index crop: the mask is never interpolated, which is the
nearest-neighbour rule at scale 1), flipped left-right together with probability 0.5
(`dataset.random_flip`); an image smaller than the crop is padded (image 0, mask 0 =
background). Draws are seeded by (dataset.seed, epoch, index), so a resume redraws them. Items
are (1, C, H, W) float images, normalised by dataset.mean/std, and (1, 1, H, W) uint8 masks:
one "patch" per image, the shape task=segmentation trains on (tasks/segmentation.py). A
validation item is the whole image and mask, scored by the task's sliding window.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from accel_train.data.images.decode import GRAY_MODES, load_rgb, open_image
from accel_train.data.splits import Splits, held_out_indices
from accel_train.errors import UserError

log = logging.getLogger("accel_train")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def build_mask_folder(
    *,
    root: str,
    crop_size: int | None = None,
    random_flip: bool = True,
    num_classes: int | None = None,
    classes: Sequence[str] | None = None,
    mean: Sequence[float] = (0.5,),
    std: Sequence[float] = (0.5,),
    val_fraction: float = 0.2,
    seed: int = 0,
) -> Splits:
    """Train and val splits of a mask folder (see the module docstring)."""
    root_dir = Path(root).expanduser()
    if not (root_dir / "train" / "images").is_dir():
        raise UserError(
            f"dataset.root={root!r}: no {Path(root) / 'train' / 'images'} folder. "
            "dataset=mask_folder reads <root>/train/images/*.png|jpg and <root>/train/masks/*.png "
            "(and <root>/val/ alike, if any): point `dataset.root=` at such a folder."
        )
    if classes is not None and num_classes is not None and len(classes) != num_classes:
        raise UserError(
            f"dataset.classes names {len(classes)} classes and dataset.num_classes={num_classes}: "
            "give one of them, or make them agree."
        )
    k = num_classes if num_classes is not None else (len(classes) if classes else None)
    train_pairs = _pairs(root_dir / "train")
    val_pairs = _pairs(root_dir / "val") if (root_dir / "val" / "images").is_dir() else None
    seen = _check(train_pairs + (val_pairs or []), k)
    k = k if k is not None else max(seen + 1, 2)
    if val_pairs is None:
        train_pairs, val_pairs = _held_out(train_pairs, val_fraction, seed)
    names = [str(c) for c in classes] if classes else [str(i) for i in range(k)]
    norm = _Normalise(mean, std)
    log.info(
        "dataset=mask_folder: %d train / %d val image-mask pairs%s, %d classes (%s); training "
        "crop %s%s",
        len(train_pairs), len(val_pairs), "" if (root_dir / "val").is_dir() else " (held out)",
        k, ", ".join(names), crop_size or "none (whole images)",
        ", random left-right flip" if random_flip else "",
    )  # fmt: skip
    train = CropSet(train_pairs, names, norm, crop_size, random_flip, seed)
    size = crop_size or _size(train_pairs[0][0])[1]
    return Splits(
        train,
        WholeSet(val_pairs, names, norm),
        None,
        in_channels=3,
        image_size=int(size),
        num_classes=k,
        model_args={"spatial_dims": 2},
        only_task="segmentation",
        only_task_items="images and their label maps, no class labels",
    )


def _pairs(split: Path) -> list[tuple[Path, Path]]:
    images = sorted(p for p in (split / "images").iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise UserError(
            f"{split / 'images'}: no .png or .jpg image. Put the images there and their label "
            f"maps in {split / 'masks'} (same file stems, .png)."
        )
    pairs = []
    for image in images:
        mask = split / "masks" / f"{image.stem}.png"
        if not mask.is_file():
            raise UserError(
                f"{image}: this image has no mask ({mask} does not exist). Every image needs its "
                "label map under masks/ with the same stem, as a .png; add it or remove the image."
            )
        pairs.append((image, mask))
    return pairs


def _size(path: Path) -> tuple[int, int]:
    """(height, width) from the header."""
    with open_image(str(path), str(path)) as im:
        w, h = im.size
    return h, w


def read_mask(path: Path) -> np.ndarray:
    with open_image(str(path), str(path)) as im:
        if im.mode not in ("L", "P", "I", "I;16", "1"):
            raise UserError(
                f"{path}: a mask of pixel mode {im.mode}, not a label map. Save masks as "
                "single-channel PNGs (mode L or P) whose pixel values are the class indices."
            )
        return np.asarray(im).astype(np.int64)


def _check(pairs: list[tuple[Path, Path]], k: int | None) -> int:
    """The header check of every pair; returns the largest label value seen."""
    top = 0
    for image, mask in pairs:
        size, mask_size = _size(image), _size(mask)
        if size != mask_size:
            raise UserError(
                f"{mask}: the mask is {mask_size[1]}x{mask_size[0]} (WxH) and its image {image} "
                f"is {size[1]}x{size[0]}: a label map must have its image's size. Fix or remove "
                "the pair."
            )
        values = np.unique(read_mask(mask))
        bad = values[values >= k] if k is not None else values[values < 0]
        if len(bad):
            raise UserError(
                f"{mask}: label value(s) {bad.tolist()[:8]} are not classes: with "
                f"dataset.num_classes={k} a mask holds values 0..{(k or 1) - 1}. Set "
                "`dataset.num_classes` (or `dataset.classes`) to the number of classes, or fix "
                "the mask."
            )
        top = max(top, int(values.max(initial=0)))
    return top


def _held_out(pairs: list, fraction: float, seed: int) -> tuple[list, list]:
    n = len(pairs)
    k = round(n * fraction)
    if k < 1 or n - k < 1:
        raise UserError(
            f"dataset.val_fraction={fraction} of the {n} training pair(s) holds out {k} for "
            f"validation and leaves {n - k}: each side needs at least one. Set "
            "dataset.val_fraction accordingly, or add a <root>/val/ split."
        )
    train_idx, val_idx = held_out_indices(n, fraction, seed)
    return [pairs[i] for i in train_idx.tolist()], [pairs[i] for i in sorted(val_idx.tolist())]


class _Normalise:
    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean = torch.tensor(list(mean), dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(list(std), dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        return (pixels.float() / 255.0 - self.mean) / self.std


def load_pair(image: Path, mask: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 (3, H, W) pixels and int64 (1, H, W) labels."""
    with open_image(str(image), str(image)) as im:
        if im.mode in GRAY_MODES:  # one-channel images (microscopy, X-ray): the same in R, G, B
            im = im.convert("RGB")
        pixels = load_rgb(im, 1, str(image), str(image))
    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1), torch.from_numpy(
        read_mask(mask)
    )[None]


class CropSet(Dataset):
    """Training: item i is pair i's random crop (same box for image and mask), maybe flipped."""

    def __init__(self, pairs, classes, norm, crop: int | None, flip: bool, seed: int):
        self.pairs, self.classes, self.norm = pairs, classes, norm
        self.crop, self.flip, self.seed = crop, flip, seed

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        return self.getitem(i, 0)

    def getitem(self, i: int, epoch: int):
        image, mask = load_pair(*self.pairs[i])
        digest = hashlib.sha256(f"{self.seed}/{epoch}/{i}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        if self.crop:
            image, mask = _pad(image, self.crop), _pad(mask, self.crop)
            h, w = image.shape[-2:]
            top = int(torch.randint(h - self.crop + 1, (1,), generator=gen))
            left = int(torch.randint(w - self.crop + 1, (1,), generator=gen))
            box = (slice(None), slice(top, top + self.crop), slice(left, left + self.crop))
            image, mask = image[box], mask[box]
        if self.flip and bool(torch.rand((), generator=gen) < 0.5):
            image, mask = image.flip(-1), mask.flip(-1)
        return self.norm(image)[None], mask.to(torch.uint8)[None]


def _pad(x: torch.Tensor, size: int) -> torch.Tensor:
    h, w = x.shape[-2:]
    if h >= size and w >= size:
        return x
    return torch.nn.functional.pad(x, (0, max(size - w, 0), 0, max(size - h, 0)))


def whole_images(items):
    """The validation collate: images may differ in size, so a batch is (list of images, list
    of masks), each scored alone by the sliding window."""
    return [x for x, _ in items], [y for _, y in items]


class WholeSet(Dataset):
    """Validation: item i is pair i whole, (C, H, W) and (1, H, W)."""

    collate = staticmethod(whole_images)

    def __init__(self, pairs, classes, norm):
        self.pairs, self.classes, self.norm = pairs, classes, norm

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        image, mask = load_pair(*self.pairs[i])
        return self.norm(image), mask.to(torch.uint8)

    def case_name(self, i: int) -> str:
        return self.pairs[i][0].stem

    def write_prediction(self, i: int, labels: np.ndarray, folder: Path) -> Path:
        """accel-eval: the predicted label map of pair i as a PNG (mode L), named as its mask."""
        from PIL import Image

        path = folder / f"{self.case_name(i)}.png"
        Image.fromarray(np.asarray(labels, np.uint8)).save(path)
        return path
