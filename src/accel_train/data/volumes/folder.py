"""`dataset=volume_folder`: 3-D segmentation from a Medical Segmentation Decathlon or nnU-Net v2
folder (data/volumes/layout.py), on MONAI's transforms (data/volumes/transforms.py).

The cases with labels (imagesTr/ + labelsTr/) are split by a seeded hold-out of
`dataset.val_fraction` (at least one case on each side, or a refusal with the numbers). Every
case is read and checked once (data/volumes/check.py) before anything is written; then the
deterministic part runs once per case and is kept (`dataset.cache`):

- `memory`: every case preprocessed at start-up and held in this process (MONAI's CacheDataset;
  forked loader workers share it);
- `disk`: arrays plus JSON in `dataset.cache_dir`, reused by later runs and sweeps until a file
  or a deterministic setting changes (data/volumes/cache.py);
- `none`: preprocessed again each time an item is read (MONAI's plain Dataset).

A training item is one volume's `samples_per_volume` random patches, (S, C, X, Y, Z) and
(S, 1, X, Y, Z): the loader's batch is `loader.batch_size` volumes, each step trains on
batch_size x samples_per_volume patches. Its random draws are seeded by (dataset.seed, epoch,
index) through MONAI's set_random_state, so the patches are the same for any number of loader
workers and after a mid-epoch resume. A validation item is a whole volume, (C, X, Y, Z) and
(1, X, Y, Z), scored by the task's sliding window (tasks/segmentation.py)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from accel_train.data.splits import Splits, held_out_indices
from accel_train.data.volumes import cache as disk
from accel_train.data.volumes.check import fingerprint
from accel_train.data.volumes.layout import Case, Layout, read_layout
from accel_train.data.volumes.transforms import deterministic, random_patches
from accel_train.errors import UserError

log = logging.getLogger("accel_train")
CACHES = ("memory", "disk", "none")
# CT's default foreground: above -500 HU is the body (fat is about -100), below it the air.
CT_BODY = -500.0


def build_volume_folder(
    *,
    root: str,
    val_fraction: float = 0.2,
    seed: int = 0,
    orientation: str = "RAS",
    spacing: Sequence[float] | None = None,
    intensity_range: Sequence[float] | None = None,
    crop_foreground: bool = True,
    foreground_threshold: float | None = None,
    cache: str = "memory",
    cache_dir: str | None = None,
    patch_size: Sequence[int] = (96, 96, 96),
    samples_per_volume: int = 4,
    pos_neg_ratio: float = 1.0,
    random_flip: bool = True,
) -> Splits:
    """Train and val splits of a Decathlon or nnU-Net v2 folder (see the module docstring)."""
    patch = _check_options(cache, orientation, spacing, intensity_range, patch_size,
                           samples_per_volume, pos_neg_ratio)  # fmt: skip
    root_dir = Path(root).expanduser()
    if not root_dir.is_dir():
        raise UserError(
            f"dataset.root={root!r}: no such folder. Point `dataset.root=` at a Decathlon folder "
            "(e.g. Task09_Spleen: dataset.json, imagesTr/, labelsTr/) or an nnU-Net v2 raw one."
        )
    store = disk.DiskCache(disk.cache_folder(cache_dir, root_dir)) if cache == "disk" else None
    layout = read_layout(root_dir)
    train_cases, val_cases = _held_out(layout.cases, val_fraction, seed)
    fp = _fingerprint(layout, train_cases, orientation, seed, store)
    settings = _settings(layout, fp, orientation, spacing, intensity_range,
                         crop_foreground, foreground_threshold)  # fmt: skip
    prep = deterministic(orientation, settings["spacing"], settings["intensity_range"],
                         settings["crop_threshold"])  # fmt: skip
    made = _Preprocessed(prep, settings, store)
    train = [made.entry(c, lazy=cache == "none") for c in train_cases]
    val = [made.entry(c, lazy=cache == "none") for c in val_cases]
    _log_summary(layout, train_cases, val_cases, settings, cache, store, made)
    patches = random_patches(patch, samples_per_volume, pos_neg_ratio, random_flip)
    train_set = PatchSet(train, patches, seed, layout.classes)
    val_set = VolumeSet(val, layout.classes)
    return Splits(
        train_set,
        val_set,
        None,
        in_channels=len(layout.channels),
        image_size=int(patch[0]),
        num_classes=len(layout.classes),
        model_args={"spatial_dims": 3},
        only_task="segmentation",
        only_task_items="patches of volumes and their label maps, no class labels",
    )


def _check_options(cache, orientation, spacing, intensity_range, patch_size, samples, ratio):
    if cache not in CACHES:
        raise UserError(
            f"dataset.cache={cache!r}: one of {', '.join(CACHES)}, e.g. `dataset.cache=disk`."
        )
    if len(str(orientation)) != 3 or set(str(orientation).upper()) - set("RASLPI"):
        raise UserError(f"dataset.orientation={orientation!r}: three axis codes, e.g. RAS or LPS.")
    if spacing is not None and (len(spacing) != 3 or min(spacing) <= 0):
        raise UserError(f"dataset.spacing={list(spacing)}: three positive values in mm, or null.")
    if intensity_range is not None and (
        len(intensity_range) != 2 or intensity_range[0] >= intensity_range[1]
    ):
        raise UserError(
            f"dataset.intensity_range={list(intensity_range)}: [low, high] with low < high "
            "(CT's window in HU, e.g. [-57, 164] for the spleen), or null."
        )
    patch = [int(p) for p in patch_size]
    if len(patch) != 3 or min(patch) < 1:
        raise UserError(
            f"dataset.patch_size={patch}: three positive sizes in voxels, e.g. [96,96,96]."
        )
    if samples < 1 or ratio < 0:
        raise UserError(
            f"dataset.samples_per_volume={samples} and dataset.pos_neg_ratio={ratio}: at least 1 "
            "patch per volume, and a ratio >= 0."
        )
    return patch


def _held_out(cases: list[Case], fraction: float, seed: int) -> tuple[list[Case], list[Case]]:
    n = len(cases)
    k = round(n * fraction)
    if k < 1 or n - k < 1:
        raise UserError(
            f"dataset.val_fraction={fraction} of the {n} labelled case(s) holds out {k} for "
            f"validation and leaves {n - k} for training: each side needs at least one case. "
            f"Set dataset.val_fraction between {1 / n:.3g} and {(n - 1) / n:.3g}"
            + (" (or add cases)." if n > 1 else "; one case cannot be split: add cases.")
        )
    train_idx, val_idx = held_out_indices(n, fraction, seed)
    return [cases[i] for i in train_idx.tolist()], [cases[i] for i in sorted(val_idx.tolist())]


def _fingerprint(layout: Layout, train: list[Case], orientation: str, seed: int, store) -> dict:
    """The checked data set's fingerprint, kept in the disk cache when there is one."""
    files = [f for c in layout.cases for f in (*c.images, c.label)]
    name = None
    if store is not None:
        key = disk.key_of(files, {"orientation": orientation, "seed": seed,
                                  "train": [c.name for c in train]})  # fmt: skip
        name = f"fingerprint-{key}.json"
        kept = store.load_json(name)
        if kept is not None:
            return kept
    fp = fingerprint(layout, train, orientation, seed)
    if store is not None:
        store.store_json(name, fp)
    return fp


def _settings(layout, fp, orientation, spacing, intensity_range, crop, threshold) -> dict:
    window = list(intensity_range) if intensity_range is not None else None
    if window is None and layout.is_ct:
        window = fp.get("intensity_range")
        if window is None:
            raise UserError(
                "dataset.intensity_range=null asks for the CT window from the training labels' "
                "foreground, and no training label has any foreground voxel. Set "
                "`dataset.intensity_range=[low,high]` (HU), or check the labels."
            )
    return {
        "orientation": orientation,
        "spacing": [float(s) for s in (spacing if spacing is not None else fp["spacing"])],
        "intensity_range": [float(v) for v in window] if window is not None else None,
        "crop_threshold": None
        if not crop
        else float(threshold if threshold is not None else (CT_BODY if layout.is_ct else 0.0)),
        "transforms": 1,  # bumped when the deterministic transforms change
    }


class _Preprocessed:
    """Runs the deterministic part for a case, through the disk cache when there is one."""

    def __init__(self, prep, settings: dict, store):
        self.prep, self.settings, self.store = prep, settings, store
        self.computed = 0
        self.nbytes = 0

    def entry(self, case: Case, lazy: bool) -> Callable[[], dict] | dict:
        if lazy:
            return _Lazy(self, case)
        key = disk.key_of([*case.images, case.label], self.settings)
        found = self.store.load(key) if self.store is not None else None
        if found is None:
            found = self.run(case)
            if self.store is not None:
                self.store.store(key, found["image"], found["label"], found["meta"])
        self.nbytes += found["image"].nbytes + found["label"].nbytes
        return found

    def run(self, case: Case) -> dict:
        image = [str(p) for p in case.images]
        out = self.prep({"image": image if len(image) > 1 else image[0], "label": str(case.label)})
        img, lab = out["image"], out["label"]
        meta = {
            "case": case.name,
            "affine": np.asarray(img.affine).tolist(),  # after the transforms
            "source_affine": np.asarray(img.meta.get("original_affine")).tolist(),
            "source_shape": [int(s) for s in np.asarray(img.meta.get("spatial_shape")).tolist()],
            "settings": self.settings,
        }
        self.computed += 1
        label = np.asarray(lab.array if hasattr(lab, "array") else lab)
        return {"image": np.asarray(img.array, np.float32),
                "label": label.astype(np.uint8 if label.max(initial=0) < 256 else np.int16),
                "meta": meta}  # fmt: skip


class _Lazy:
    """dataset.cache=none: the case preprocessed at each read (a class, not a lambda, so that
    it pickles into spawned loader workers)."""

    def __init__(self, made: _Preprocessed, case: Case):
        self.made, self.case = made, case

    def __call__(self) -> dict:
        return self.made.run(self.case)


def _log_summary(layout, train, val, settings, cache, store, made) -> None:
    where = ""
    if store is not None:
        where = f" ({store.hits} reused, {store.writes} written in {store.folder})"
    size = f", {made.nbytes / 2**20:.1f} MiB" if cache != "none" else ""
    window = settings["intensity_range"]
    log.info(
        "dataset=volume_folder: %s layout, %d cases (%d train / %d val), %d channel(s) %s, classes "
        "%s; spacing %s mm in %s, intensity %s, foreground crop %s; cache=%s%s%s",
        layout.kind, len(layout.cases), len(train), len(val), len(layout.channels),
        "/".join(layout.channels), ", ".join(layout.classes),
        "x".join(f"{s:.3g}" for s in settings["spacing"]), settings["orientation"],
        f"CT window [{window[0]:.4g}, {window[1]:.4g}]" if window else "z-score per channel",
        "off" if settings["crop_threshold"] is None else f"above {settings['crop_threshold']:g}",
        cache, size, where,
    )  # fmt: skip


def _arrays(entry) -> dict:
    found = entry() if callable(entry) else entry
    return found


def _tensor(x) -> torch.Tensor:
    t = x.as_tensor() if hasattr(x, "as_tensor") else torch.as_tensor(np.asarray(x))
    return t


class PatchSet(Dataset):
    """Training: item i is volume i's `samples_per_volume` random patches, seeded by
    (seed, epoch, i)."""

    def __init__(self, entries: list, patches, seed: int, classes: list[str]):
        self.entries, self.patches, self.seed, self.classes = entries, patches, seed, classes

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int):
        return self.getitem(i, 0)

    def getitem(self, i: int, epoch: int):
        found = _arrays(self.entries[i])
        digest = hashlib.sha256(f"{self.seed}/{epoch}/{i}".encode()).digest()
        self.patches.set_random_state(seed=int.from_bytes(digest[:4], "little"))
        data = {"image": np.array(found["image"]), "label": np.array(found["label"])}
        out = self.patches(data)
        image = torch.stack([_tensor(d["image"]).float() for d in out])
        label = torch.stack([_tensor(d["label"]).to(torch.uint8) for d in out])
        return image, label


def whole_volumes(items):
    """The validation collate: volumes differ in size, so a batch is (list of images, list of
    labels), each scored alone by the sliding window."""
    return [x for x, _ in items], [y for _, y in items]


class VolumeSet(Dataset):
    """Validation: item i is whole volume i after the deterministic part."""

    collate = staticmethod(whole_volumes)

    def __init__(self, entries: list, classes: list[str]):
        self.entries, self.classes = entries, classes

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int):
        found = _arrays(self.entries[i])
        return torch.from_numpy(np.array(found["image"])), torch.from_numpy(
            np.array(found["label"])
        )

    def case_name(self, i: int) -> str:
        entry = self.entries[i]
        return entry.case.name if isinstance(entry, _Lazy) else entry["meta"]["case"]

    def write_prediction(self, i: int, labels: np.ndarray, folder: Path) -> Path:
        """accel-eval: case i's predicted label map as NIfTI on the preprocessed grid, with that
        grid's affine (the source affine after orientation, spacing and crop): it lies where the
        source volume lies in world coordinates; it is not resampled back to the source grid."""
        import nibabel

        meta = _arrays(self.entries[i])["meta"]
        path = folder / f"{self.case_name(i)}.nii.gz"
        image = nibabel.Nifti1Image(np.asarray(labels, np.uint8), np.asarray(meta["affine"]))
        nibabel.save(image, path)
        return path
