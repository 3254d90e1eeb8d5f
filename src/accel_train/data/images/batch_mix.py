"""The batch-wise recipe switches on the device (issue 38): random erasing, then mixup/cutmix,
on a normalised training batch, in the order timm applies them (its loader's PrefetchLoader
erases after normalising; its train loop mixes the loader's batches). Both are timm's own
objects, called as timm calls them:

- ``dataset.random_erasing`` (probability), ``random_erasing_mode`` (pixel | rand | const),
  ``random_erasing_count``: ``timm.data.random_erasing.RandomErasing(probability, mode=...,
  max_count=count, device=...)``, timm's ``--reprob --remode --recount``.
- ``dataset.mixup_alpha``, ``cutmix_alpha``, ``mixup_prob``, ``mixup_switch_prob``,
  ``mixup_mode``: ``timm.data.Mixup``, with the loss's label smoothing folded into the targets
  (timm's ``label_smoothing``). Its targets are soft, float [B, C] (``mixup_target``); the
  hard labels travel beside them for train/acc: a training batch becomes (x, soft, labels).

Both draw from the process-wide generators (Mixup: numpy's; RandomErasing: Python's and the
device's torch generator), so each call runs under :func:`seeded_rngs` with a seed derived from
(seed, epoch, batch, rank): a mid-epoch resume gives the same boxes, lambdas and noise, and no
other random stream moves. Nothing reads a device value on the host (timm's draws are numpy
and Python numbers; the boxes are host ints).
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from accel_train.data.seeded import derive_seed, seeded_rngs

# Separate streams for the two steps, so turning one on does not change the other's draws.
_ERASE, _MIX = 1, 2


def mixing_on(ds: DictConfig) -> bool:
    """mixup or cutmix is on: the training targets are soft."""
    return float(ds.get("mixup_alpha", 0) or 0) > 0 or float(ds.get("cutmix_alpha", 0) or 0) > 0


def batch_mix_on(ds: DictConfig) -> bool:
    return mixing_on(ds) or float(ds.get("random_erasing", 0) or 0) > 0


class BatchMix:
    """Training batches (normalised x [B, C, H, W], int64 labels [B]) -> (x, labels) with
    erasing only, or (x, soft targets float32 [B, classes], labels) with mixing."""

    def __init__(self, erase: Any, mix: Any, *, seed: int, rank: int, device: torch.device):
        self.erase, self.mix = erase, mix
        self.seed, self.rank, self.device = seed, rank, device

    @property
    def soft_targets(self) -> bool:
        return self.mix is not None

    def __call__(self, x: torch.Tensor, labels: torch.Tensor, epoch: int, batch: int):
        if self.erase is not None:
            with seeded_rngs(self._seed(_ERASE, epoch, batch), self.device):
                x = self.erase(x)
        if self.mix is None:
            return x, labels
        with seeded_rngs(self._seed(_MIX, epoch, batch), self.device):
            x, soft = mix_batch(self.mix, x, labels)
        return x, soft, labels

    def _seed(self, stream: int, epoch: int, batch: int) -> int:
        return derive_seed(self.seed, epoch, batch, self.rank, stream)


def mix_batch(mix, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``timm.data.Mixup.__call__`` (x mixed in place, the soft targets), without its assertion
    that the batch is even: the batch and elem modes mix an odd batch correctly (the middle
    sample of batch mode is mixed with itself), and a short last batch may be odd. Pair mode
    needs even batches: refused in config/recipe_checks.py unless every batch is even."""
    from timm.data.mixup import mixup_target

    if mix.mode == "elem":
        lam = mix._mix_elem(x)
    elif mix.mode == "pair":
        lam = mix._mix_pair(x)
    else:
        lam = mix._mix_batch(x)
    return x, mixup_target(labels, mix.num_classes, lam, mix.label_smoothing)


def build_batch_mix(
    ds: DictConfig, num_classes: int, label_smoothing: float, *, seed: int, rank: int, device
) -> BatchMix | None:
    """The dataset's batch switches as timm's objects (None: all off). The values were checked
    with the config (config/recipe_checks.py)."""
    if not batch_mix_on(ds):
        return None
    erase = mix = None
    if float(ds.random_erasing) > 0:
        from timm.data.random_erasing import RandomErasing

        erase = RandomErasing(
            float(ds.random_erasing),
            mode=str(ds.random_erasing_mode),
            max_count=int(ds.random_erasing_count),
            device=device,
        )
    if mixing_on(ds):
        from timm.data import Mixup

        mix = Mixup(
            mixup_alpha=float(ds.mixup_alpha),
            cutmix_alpha=float(ds.cutmix_alpha),
            prob=float(ds.mixup_prob),
            switch_prob=float(ds.mixup_switch_prob),
            mode=str(ds.mixup_mode),
            label_smoothing=float(label_smoothing),
            num_classes=num_classes,
        )
    return BatchMix(erase, mix, seed=seed, rank=rank, device=device)
