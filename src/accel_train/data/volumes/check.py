"""The header check and the data set's fingerprint, in one reading pass before anything is
written (nnU-Net's `verify_dataset_integrity` and dataset fingerprint, in small):

- every file is read whole (a truncated `.nii.gz` fails here, named, not in a loader worker);
- an image and its label must have the same voxel grid (shape and spacing); affines that differ
  slightly are warned, not refused (nnU-Net warns too: exports often round them);
- label values must be classes of dataset.json's `labels`;
- the fingerprint: the median spacing of the training cases in the `dataset.orientation` axes
  (the default target spacing, as nnU-Net's) and, for CT, the 0.5 and 99.5 percentiles of the
  intensities inside the labelled foreground (the default window, as nnU-Net's CT
  normalisation clips to them).

With `dataset.cache=disk` the fingerprint is kept beside the cached volumes, keyed by every
file's size and modification time: an unchanged data set is not read twice."""

from __future__ import annotations

import logging
import zlib
from pathlib import Path

import numpy as np

from accel_train.data.volumes.layout import Case, Layout
from accel_train.errors import UserError

log = logging.getLogger("accel_train")

# Foreground voxels sampled per case for the CT window (nnU-Net samples 10 000 per case).
FOREGROUND_SAMPLES = 10_000
PERCENTILES = (0.5, 99.5)


def _nib():
    try:
        import nibabel
    except ImportError:
        raise UserError(
            "dataset=volume_folder needs nibabel (and MONAI), which are not installed. Install "
            'the medical extra: `pip install "accel-train[medical]"`.'
        ) from None
    return nibabel


def _read(path: Path):
    """(the nibabel image, its voxels) of a whole file, or a UserError naming it."""
    nib = _nib()
    try:
        img = nib.load(str(path))
        data = np.asanyarray(img.dataobj)
    except (OSError, EOFError, zlib.error, ValueError, nib.filebasedimages.ImageFileError) as err:
        raise UserError(
            f"{path}: the file cannot be read as NIfTI ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:200]}); it is truncated or damaged. Copy it again, or "
            "remove the case from the data set."
        ) from None
    return img, data


def ras_spacing(img, orientation: str) -> list[float]:
    """The voxel spacing along the axes of `orientation` (after MONAI's Orientationd)."""
    nib = _nib()
    zooms = [float(z) for z in img.header.get_zooms()[:3]]
    ornt = nib.orientations.io_orientation(img.affine)
    target = nib.orientations.axcodes2ornt(tuple(orientation))
    out = [0.0, 0.0, 0.0]
    for voxel_axis, (world_axis, _) in enumerate(ornt[:3]):
        out[int(target[int(world_axis), 0])] = zooms[voxel_axis]
    return out


def check_case(case: Case, layout: Layout, orientation: str, rng) -> tuple[list[float], np.ndarray]:
    """One case checked: (its spacing in the target axes, a sample of its foreground intensities
    of the first channel)."""
    label_img, label = _read(case.label)
    if label.ndim != 3:
        raise UserError(
            f"{case.label}: a label map must be 3-D, and this one has shape {label.shape}. Give "
            "one integer class per voxel."
        )
    first = None
    for path in case.images:
        img, data = _read(path)
        spatial = data.shape[:3]
        if spatial != label.shape:
            raise UserError(
                f"{path}: the image's voxel grid {spatial} differs from its label's "
                f"{label.shape} ({case.label}). An image and its label must have the same shape: "
                "resample the label onto the image."
            )
        zi = np.asarray(img.header.get_zooms()[:3], float)
        zl = np.asarray(label_img.header.get_zooms()[:3], float)
        if not np.allclose(zi, zl, rtol=1e-3, atol=1e-4):
            raise UserError(
                f"{path}: spacing {zi.round(4).tolist()} mm, but its label {case.label} has "
                f"{zl.round(4).tolist()} mm. They must match: resample the label onto the image."
            )
        if not np.allclose(img.affine, label_img.affine, atol=1e-3):
            log.warning(
                "dataset=volume_folder: %s and its label %s have slightly different affines "
                "(as nnU-Net's check, warned, not refused): the label is read on the image's grid",
                path, case.label,
            )  # fmt: skip
        if first is None:
            first = (img, data)
    values = np.unique(label)
    classes = layout.classes
    bad = [v for v in values.tolist() if v != int(v) or not 0 <= int(v) < len(classes)]
    if bad:
        raise UserError(
            f"{case.label}: label value(s) {bad[:5]} are not classes of dataset.json's labels "
            f"(0..{len(classes) - 1}: {', '.join(classes)}). Fix the label map, or add the "
            "classes to dataset.json."
        )
    img, data = first
    volume = data if data.ndim == 3 else data[..., 0]
    fg = volume[label > 0]
    if fg.size > FOREGROUND_SAMPLES:
        fg = rng.choice(fg, FOREGROUND_SAMPLES, replace=False)
    return ras_spacing(img, orientation), np.asarray(fg, np.float64)


def fingerprint(layout: Layout, cases: list[Case], orientation: str, seed: int) -> dict:
    """Check every case (all of them: validation cases are read too) and measure the training
    ones: {"spacing": median [x, y, z], "intensity_range": [lo, hi] or None}."""
    rng = np.random.default_rng(seed)
    training = {c.name for c in cases}
    spacings, foreground = [], []
    for case in layout.cases:
        spacing, fg = check_case(case, layout, orientation, rng)
        if case.name in training:
            spacings.append(spacing)
            foreground.append(fg)
    window = None
    if layout.is_ct:
        values = np.concatenate(foreground) if foreground else np.empty(0)
        if values.size:
            window = [float(v) for v in np.percentile(values, PERCENTILES)]
    return {"spacing": [float(v) for v in np.median(np.asarray(spacings), axis=0)],
            "intensity_range": window}  # fmt: skip
