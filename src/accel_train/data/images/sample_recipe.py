"""The per-sample recipe switches (issue 38), handed to a split that crops each training sample
itself through its two hooks (data/images/folder_uncached.py's ``sample_augment`` and ``size_at``):

- ``dataset.auto_augment``: timm's policies by timm's strings, built by timm's own functions
  with the ``hparams`` timm's ``transforms_factory`` gives them (``translate_const`` = 45 % of
  the image side, ``img_mean`` = the dataset mean in 0-255, the dataset's interpolation):
  ``rand-...`` (RandAugment, ``rand_augment_transform``), ``augmix-...``
  (``augment_and_mix_transform``), ``original``/``v0``/``3a``... (``auto_augment_transform``).
  timm 1.0 has no TrivialAugment: ``trivial`` is torchvision's ``TrivialAugmentWide`` (filled
  with the mean and resized with the interpolation above, as timm's ops are). It runs in the
  loader worker on the cropped, flipped sample as a PIL image (timm's ops are PIL operations),
  after the crop as in timm's transform order, with every random draw seeded by the sample's own
  seeded ``random.Random`` (seed, epoch, index): data/seeded.py.
- ``trainer.progressive_resize``: FFCV's schedule of the training image side per epoch
  (:class:`ProgressiveSizes`); evaluation keeps its size.

timm and torchvision are imported where a policy is first built (the workers, or the check in
the launching process), never at start-up.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

import numpy as np
import torch
from omegaconf import DictConfig

from accel_train.config.recipe_checks import policy_sections_problem
from accel_train.config.schema import ProgressiveResizeConfig
from accel_train.data.seeded import seeded_rngs
from accel_train.data.splits import Splits
from accel_train.errors import UserError

EXAMPLES = "`rand-m9-mstd0.5-inc1` (RandAugment), `trivial`, `augmix-m5-w3`, `original`"


def make_policy(spec: str, size: int, mean, interpolation: str):
    """The PIL transform ``spec`` names, for images of side ``size``, built as timm's
    transforms_factory builds it (see the module docstring)."""
    from timm.data.transforms import str_to_pil_interp

    img_mean = tuple(min(255, round(255 * float(m))) for m in mean)
    img_mean = img_mean * 3 if len(img_mean) == 1 else img_mean
    pil_interp = str_to_pil_interp(interpolation)
    if spec == "trivial":
        from torchvision.transforms import InterpolationMode, TrivialAugmentWide

        return TrivialAugmentWide(
            interpolation=InterpolationMode(interpolation), fill=list(img_mean)
        )
    from timm.data.auto_augment import (
        augment_and_mix_transform,
        auto_augment_transform,
        rand_augment_transform,
    )

    hparams = {
        "translate_const": int(size * 0.45),
        "img_mean": img_mean,
        "interpolation": pil_interp,
    }
    if spec.startswith("rand"):
        return rand_augment_transform(spec, hparams)
    if spec.startswith("augmix"):
        hparams["translate_pct"] = 0.3  # as transforms_factory sets it for AugMix
        return augment_and_mix_transform(spec, hparams)
    return auto_augment_transform(spec, hparams)


class AutoAugment:
    """``sample_augment`` for ``dataset.auto_augment``: uint8 [3, S, S] and the sample's
    ``random.Random`` -> uint8 [3, S, S]. The policy is built per image side (progressive
    resizing changes it; ``translate_const`` follows it) in the process that runs it."""

    def __init__(self, spec: str, mean, interpolation: str):
        self.spec, self.mean, self.interpolation = spec, tuple(mean), interpolation
        self._policies: dict[int, object] = {}

    def policy(self, size: int):
        made = self._policies.get(size)
        if made is None:
            made = self._policies[size] = make_policy(
                self.spec, size, self.mean, self.interpolation
            )
        return made

    def __call__(self, image: torch.Tensor, rng: random.Random) -> torch.Tensor:
        from PIL import Image

        policy = self.policy(image.shape[-1])
        pil = Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).numpy()))
        # One draw of the sample's generator seeds Python's, numpy's and torch's generators
        # for the policy's own draws (timm draws from random and np.random, torchvision's
        # TrivialAugmentWide from torch), restored afterwards.
        with seeded_rngs(rng.getrandbits(32)):
            out = policy(pil)
        return torch.from_numpy(np.array(out, dtype=np.uint8)).permute(2, 0, 1)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_policies": {}}  # rebuilt in each worker, on first use


@dataclass(frozen=True)
class ProgressiveSizes:
    """``size_at`` for ``trainer.progressive_resize``: FFCV's ``get_resolution`` (its ImageNet
    example's train_imagenet.py) with ``step`` for its 32: ``start_size`` up to
    ``start_epoch``, ``end_size`` from ``end_epoch``, between them the linear interpolation
    rounded to a multiple of ``step``."""

    start_size: int
    end_size: int
    start_epoch: int
    end_epoch: int
    step: int = 32

    def __call__(self, epoch: int) -> int:
        if epoch <= self.start_epoch:
            return self.start_size
        if epoch >= self.end_epoch:
            return self.end_size
        interp = np.interp(
            [epoch], [self.start_epoch, self.end_epoch], [self.start_size, self.end_size]
        )
        return int(np.round(interp[0] / self.step)) * self.step


def progressive_sizes(node) -> ProgressiveSizes:
    """trainer.progressive_resize (checked with the config: config/recipe_checks.py; a key left
    out at ProgressiveResizeConfig's default) -> its schedule."""
    values = {f.name: f.default for f in fields(ProgressiveResizeConfig)}
    values.update({k: int(v) for k, v in node.items()})
    return ProgressiveSizes(**values)


def hooked_crop(split, base: torch.Tensor, draw: str, epoch: int) -> torch.Tensor:
    """A cached base image's training crop (image_folder's ImageFolderSplit, view="random")
    with the hooks set: the crop drawn as without them, resized to the epoch's size, then the
    sample augmentation, all from the sample's seeded draws (as data/images/folder_uncached.py
    does)."""
    rng = random.Random(draw)
    size = split.size_at(epoch) if split.size_at else split.size
    top, left, h, w = split.crop.box(base.shape[-2], base.shape[-1], rng)
    image = split.crop.finish(base[:, top : top + h, left : left + w], size, rng)
    return split.sample_augment(image, rng) if split.sample_augment else image


def takes_sample_hooks(split) -> bool:
    """Whether the split crops each training sample itself (then it reads ``size_at`` and
    ``sample_augment``): image_folder's photos and its cached base images with augment=cpu."""
    return getattr(split, "crop", None) is not None and hasattr(split, "size_at")


def apply_sample_recipe(ds: DictConfig, trainer: DictConfig, splits: Splits) -> None:
    """Give the training split the per-sample switches the config turns on, or refuse them in
    one paragraph when it cannot take them. Before the loader starts its workers: the hooks
    travel with the split."""
    spec, resize = ds.get("auto_augment"), trainer.get("progressive_resize")
    if not spec and resize is None:
        return
    if not takes_sample_hooks(splits.train):
        key = "dataset.auto_augment" if spec else "trainer.progressive_resize"
        raise UserError(
            f"{key} changes each training sample in the loader, after its random crop, and "
            f"dataset={ds.get('name')} with these options crops no sample itself (image_folder "
            "does with `dataset.augment=cpu`, from photos or from a cache). Use "
            f"`dataset=image_folder dataset.augment=cpu`, or drop `{key}`."
        )
    if spec:
        splits.train.sample_augment = auto_augment(str(spec), ds, splits.image_size)
    if resize is not None:
        splits.train.size_at = progressive_sizes(resize)


def auto_augment(spec: str, ds: DictConfig, size: int) -> AutoAugment:
    """dataset.auto_augment checked (its policy built once here) -> the sample hook."""
    made = AutoAugment(spec, ds.mean, ds.get("interpolation", "bilinear"))
    try:
        problem = policy_sections_problem(spec)
        if problem:
            raise ValueError(problem)
        made.policy(size)
    except (AssertionError, KeyError, ValueError, IndexError) as err:
        raise UserError(
            f"dataset.auto_augment={spec!r} is not a policy timm can build ({err or 'bad section'}"
            f"): use timm's spelling, e.g. {EXAMPLES} (timm's auto_augment.py lists the "
            "sections: m magnitude, n ops, mstd magnitude noise, inc increasing ops), or null."
        ) from None
    return made
