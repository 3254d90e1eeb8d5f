"""MONAI's transforms, in the two parts of MONAI's spleen tutorials:

- deterministic, run once per case and cached (data/volumes/cache.py): load (LoadImaged:
  nibabel), channel first, `Orientationd` to dataset.orientation, `Spacingd` to the target
  spacing (bilinear for the image, nearest for the label), `CropForegroundd` on the **raw**
  intensities (after a z-score, its default "> 0" would crop away tissue below the mean): above
  `dataset.foreground_threshold`, by default -500 HU for CT (the body without the air around
  it) and 0 for other modalities (nnU-Net's crop to the non-zero region),
  then the intensity: CT clipped to the window and scaled to [0, 1] (`ScaleIntensityRanged`),
  other modalities z-scored per channel (`NormalizeIntensityd`, nnU-Net's default);
- random, run for every training item: `SpatialPadd` to the patch (a volume smaller than the
  patch is padded, not refused), `RandCropByPosNegLabeld` (samples_per_volume patches,
  pos_neg_ratio : 1 centred on foreground : background), flips along each axis.

The random part is seeded per item (data/volumes/folder.py) through MONAI's own
`set_random_state`, so the patches do not depend on the number of loader workers and a
mid-epoch resume draws the same ones."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KEYS = ("image", "label")
AXES = (("L", "R"), ("P", "A"), ("I", "S"))  # nibabel's world axes (MONAI's default, said)


class Above:
    """CropForegroundd's select_fn: voxels above `threshold` are foreground (a class, not a
    lambda, so the transform pickles into spawned loader workers)."""

    def __init__(self, threshold: float):
        self.threshold = float(threshold)

    def __call__(self, x):
        return x > self.threshold


def deterministic(
    orientation: str,
    spacing: Sequence[float],
    intensity_range: Sequence[float] | None,
    crop_threshold: float | None,
):
    """The cached part: file paths in, {"image": (C, X, Y, Z) float, "label": (1, X, Y, Z)} out.
    `intensity_range` given: the CT window; None: z-score per channel. `crop_threshold`: the
    raw intensity above which a voxel is foreground (None: no crop)."""
    from monai import transforms as T

    steps = [
        T.LoadImaged(keys=KEYS, image_only=True),
        T.EnsureChannelFirstd(keys=KEYS),
        T.Orientationd(keys=KEYS, axcodes=orientation, labels=AXES),
        T.Spacingd(
            keys=KEYS, pixdim=tuple(spacing), mode=("bilinear", "nearest"), dtype=np.float32
        ),  # fmt: skip
    ]
    if crop_threshold is not None:
        steps.append(T.CropForegroundd(keys=KEYS, source_key="image",
                                       select_fn=Above(crop_threshold),
                                       allow_smaller=True))  # fmt: skip
    if intensity_range is not None:
        lo, hi = intensity_range
        steps.append(T.ScaleIntensityRanged(keys="image", a_min=lo, a_max=hi, b_min=0.0,
                                            b_max=1.0, clip=True))  # fmt: skip
    else:
        steps.append(T.NormalizeIntensityd(keys="image", channel_wise=True))
    return T.Compose(steps)


def random_patches(patch_size: Sequence[int], samples: int, pos_neg_ratio: float, flip: bool):
    """The per-step part: {"image", "label"} arrays in, a list of `samples` patch dicts out."""
    from monai import transforms as T

    steps = [
        T.SpatialPadd(keys=KEYS, spatial_size=tuple(patch_size)),
        T.RandCropByPosNegLabeld(
            keys=KEYS,
            label_key="label",
            spatial_size=tuple(patch_size),
            pos=float(pos_neg_ratio),
            neg=1.0,
            num_samples=int(samples),
            image_key="image",
            image_threshold=0.0,
        ),  # fmt: skip
    ]
    if flip:
        steps += [T.RandFlipd(keys=KEYS, prob=0.5, spatial_axis=a) for a in range(3)]
    return T.Compose(steps)
