"""The folders of an ImageFolder tree (torchvision's layout) and which split each one is.

    <root>/<train_split>/<class>/*.jpg|png|webp|...   training images
    <root>/<val_split>/<class>/...                    validation images (ImageNet's val/)
    <root>/<test_split>/<class>/...                   test images

The rule (docs/vision.md "Which folder is which split"), as timm and ImageNet users expect:
- train/ and val/: train on all of train/, validate on val/ (the log says so); test/ too, when it
  exists, is the test split;
- no val/ (train/ alone, or train/ and test/): validation is a seeded, stratified
  ``val_fraction`` of train/, held out;
- ``holdout=true`` (asked): validation is held out of train/ even with a val/, which then is the
  test split unless a test/ exists (the layout before issue 47).
A ``test_split`` named like ``val_split`` (``dataset.test_split=val``) asks for that too.
Files of other formats than torchvision's ImageFolder reads are skipped, counted and named in
one line.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from accel_train.data.splits import held_out_indices
from accel_train.errors import UserError

log = logging.getLogger(__name__)

# torchvision's ImageFolder IMG_EXTENSIONS (torchvision/datasets/folder.py): what it reads.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SKIPPED_SHOWN = 5  # skipped files named in the one line that counts them


@dataclass(frozen=True)
class FileKind:
    """What a tree holds (the same layout rule serves image and video folders): the option's
    name for the log, a noun for the files, and the extensions read."""

    option: str = "image_folder"
    noun: str = "images"
    extensions: tuple[str, ...] = IMAGE_EXTENSIONS
    reader: str = "torchvision's ImageFolder"


IMAGES = FileKind()


@dataclass
class Folder:
    """One split folder: its class names and image files (relative paths, sorted)."""

    path: Path
    classes: list[str]
    files: list[str]
    labels: torch.Tensor  # int64, one per file
    skipped: tuple[str, ...] = ()  # files of other formats, relative to path


@dataclass
class Layout:
    """Which folder is which split: validation is ``val`` whole, or held out of ``train``
    (``val`` None); ``test`` None: no test split."""

    train: Folder
    val: Folder | None
    test: Folder | None

    def indices(self, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(training indices of train/, held-out validation indices of train/ or None when
        validation is the val folder)."""
        n = len(self.train.files)
        if self.val is not None:
            return torch.arange(n), None
        return held_out_indices(n, fraction, seed, self.train.labels)


def plan_layout(
    root: Path, train_split: str, val_split: str | None, test_split: str | None,
    holdout: bool, val_fraction: float, kind: FileKind = IMAGES,
) -> Layout:  # fmt: skip
    """The tree's :class:`Layout` by the module docstring's rule, every folder scanned (a
    layout error before anything is decoded), and one line saying which folder is which."""
    train = scan_folder(root, train_split, "dataset.train_split", kind=kind)

    def folder(name: str | None, key: str) -> Folder | None:
        if not name or not (root / name).is_dir():
            return None
        return scan_folder(root, name, key, train.classes, kind=kind)

    held = holdout or (val_split and val_split == test_split)
    val = None if held else folder(val_split, "dataset.val_split")
    test = folder(test_split, "dataset.test_split")
    if held and test is None and test_split and val_split != test_split:
        test = folder(val_split, "dataset.val_split")  # holdout: val/ becomes the test split
    layout = Layout(train, val, test)
    _say(layout, val_fraction, holdout, kind)
    skipped = [str(f.path.name) + "/" + s for f in (train, val, test) if f for s in f.skipped]
    if skipped:
        shown = ", ".join(skipped[:SKIPPED_SHOWN])
        more = f" and {len(skipped) - SKIPPED_SHOWN} more" if len(skipped) > SKIPPED_SHOWN else ""
        log.warning(
            "dataset.root: skipped %d file(s) of no format %s reads (%s): %s%s",
            len(skipped), kind.reader, " ".join(kind.extensions), shown, more,
        )  # fmt: skip
    return layout


def _say(layout: Layout, fraction: float, holdout: bool, kind: FileKind) -> None:
    train, val, test = layout.train, layout.val, layout.test
    test_text = f"testing on {test.path.name}/" if test else "no test split"
    if val is not None:
        log.info(
            "dataset=%s: training on all %d %s of %s/, validating on %s/ (%d), %s "
            "(`dataset.holdout=true` holds dataset.val_fraction of %s/ out for validation "
            "instead)", kind.option, len(train.files), kind.noun, train.path.name,
            val.path.name, len(val.files), test_text, train.path.name,
        )  # fmt: skip
    else:
        why = "dataset.holdout=true" if holdout else "no validation folder"
        log.info(
            "dataset=%s: validating on %.0f%% of %s/ held out (dataset.val_fraction; "
            "%s), %s", kind.option, 100 * fraction, train.path.name, why, test_text,
        )  # fmt: skip


def scan_folder(
    root: Path, split: str, key: str, classes: list[str] | None = None, kind: FileKind = IMAGES
) -> Folder:
    """The images (``kind``'s files) of ``root/split/<class>/**``. The class names are the
    sub-folders (sorted) unless ``classes`` (the training folder's) is given: the other splits
    must use the same ones. Hidden files and folders (``.DS_Store``, macOS ``._x.jpg``,
    caches) are skipped silently; files of other formats are listed in ``skipped``."""
    path = root / split
    if not path.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name[0] != ".")
        raise UserError(
            f"{key}={split!r}: {path} does not exist (dataset.root holds: "
            f"{', '.join(found) or 'no folders'}). Set `{key}=<folder>` to the split's folder "
            f"under dataset.root; it holds one sub-folder of {kind.noun} per class."
        )
    names = sorted(p.name for p in path.iterdir() if p.is_dir() and p.name[0] != ".")
    if not names:
        raise UserError(
            f"{key}={split!r}: {path} has no class folders. Put each class's {kind.noun} in its "
            f"own sub-folder ({path}/<class>/*{kind.extensions[0]}), as {kind.reader} expects."
        )
    if classes is None:
        classes = names
    unknown = [c for c in names if c not in classes]
    if unknown:
        raise UserError(
            f"{key}={split!r}: the class folders {', '.join(unknown[:5])} of {path} are not "
            f"training classes ({', '.join(classes[:10])}{', ...' if len(classes) > 10 else ''}). "
            "Name the other splits' class folders like the training folder's."
        )
    index = {c: i for i, c in enumerate(classes)}
    files, labels, skipped = [], [], []
    for name in names:
        found = []
        for dirpath, dirnames, filenames in os.walk(path / name, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if d[0] != ".")
            rel = os.path.relpath(dirpath, path)
            for f in sorted(filenames):
                if f[0] != ".":
                    ok = f.lower().endswith(kind.extensions)
                    (found if ok else skipped).append(os.path.join(rel, f))
        if not found:
            raise UserError(
                f"dataset.root: the class folder {path / name} has no {kind.noun} "
                f"({' '.join(kind.extensions)}). Add its {kind.noun} or remove the folder."
            )
        files += found
        labels += [index[name]] * len(found)
    labels_t = torch.tensor(labels, dtype=torch.int64)
    return Folder(path, classes, files, labels_t, tuple(skipped))
