"""The batch transform on the device: uint8 images -> augmented, normalised float batch.

Images arrive as uint8 (the loader never makes floats on the host: a quarter of the bytes to
move) and are normalised here (one multiply, one add, in place); encoded JPEGs
(``dataset.decode=gpu``, an object with ``decode_on(device)``) are decoded and cropped on the
device first.
Video clips are (N, C, T, H, W), normalised the same way; evaluation items of several views
(data/video/folder.py: clips x crops per video) are (N, V, C, T, H, W) and leave here as N * V
clips in a row, which the task scores and averages per video. channels_last means
channels_last_3d for 5-D clips.
Signal windows (data/signals/) are float and go through their data set's own features
(``Splits.device_features``: a log-mel spectrogram, I/Q normalised per example) here, after the
copy, where a whole batch costs about what one item costs on the host.
Float inputs (a user's dataset that normalises itself) are only cast to the compute dtype and
memory format; integer inputs other than uint8 (token ids) pass unchanged. Random augmentation
is seeded by (seed, epoch, batch, rank), not by a running RNG, so a mid-epoch resume gives the
same crops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from accel_train.data.splits import Splits
from accel_train.errors import UserError


class BatchTransform:
    def __init__(
        self,
        ds: DictConfig,
        splits: Splits,
        device: torch.device,
        dtype: torch.dtype,
        *,
        seed: int,
        rank: int,
    ):
        in_channels = splits.in_channels
        mean, std = list(ds.mean), list(ds.std)
        if len(mean) not in (1, in_channels) or len(std) not in (1, in_channels):
            raise UserError(
                f"dataset.mean has {len(mean)} and dataset.std {len(std)} values but the images "
                f"have {in_channels} channels: give one value per channel (or one for all)."
            )
        std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.scale = (1.0 / (255.0 * std_t)).to(device)
        self.bias = (-mean_t / std_t).to(device)
        self.shift, self.hflip = splits.random_shift, splits.random_hflip
        self.device_augment = splits.device_augment
        self.features = splits.device_features
        self.dtype, self.device = dtype, device
        # Contiguous (NCHW) unless trainer.channels_last asks otherwise: the shift augmentation
        # gathers NHWC and permutes, and with `preserve_format` that layout reached the convs,
        # whose weight gradients then came out channels_last while the parameters (and DDP's
        # gradient buckets) are contiguous: DDP's "Grad strides do not match bucket view
        # strides" warning and a copy per gradient per step.
        self.memory_format = torch.contiguous_format
        self.seed, self.rank = seed, rank

    def __call__(self, images: torch.Tensor, train: bool, epoch: int = 0, batch: int = 0):
        if self.features is not None:  # signal windows: the data set's features, then the dtype
            gen = self._generator(epoch, batch) if train else None
            return self.features(images, train, gen).to(self.dtype)
        decode = getattr(images, "decode_on", None)
        if decode is not None:  # encoded images (dataset.decode=gpu): uint8 [N, 3, S, S] here
            images = decode(self.device)
        if images.dim() == 6:  # views of each sample (N, V, C, T, H, W): N * V clips
            images = images.flatten(0, 1)
        if images.dtype == torch.uint8:
            if train and (self.shift or self.hflip or self.device_augment):
                images = self._augment(images, self._generator(epoch, batch))
            # In place: one float batch allocated, not two (on the CPU the second allocation's
            # page faults cost more than the arithmetic), and mul_ then add_ rather than one
            # addcmul, whose broadcast bias is the slower kernel on the CPU: 14.5 vs 21.8 ms
            # for 64 x 3 x 224 x 224 on one core of the Xeon, the float conversion included.
            extra = (1,) * (images.dim() - 4)  # the channels stay dim 1: [N, C, (T,) H, W]
            scale, bias = (
                self.scale.view(*self.scale.shape, *extra),
                self.bias.view(*self.bias.shape, *extra),
            )
            x = images.float().mul_(scale).add_(bias)
        elif not images.is_floating_point():
            return images  # token ids (a text classifier's input): ids, not values to cast
        else:
            x = images
        return x.to(self.dtype, memory_format=self._format(x))

    def _generator(self, epoch: int, batch: int) -> torch.Generator:
        """The batch's random draws, seeded by (seed, epoch, batch, rank): a resume redraws them."""
        gen = torch.Generator(self.device)
        gen.manual_seed(hash((self.seed, epoch, batch, self.rank)) & 0x7FFF_FFFF_FFFF)
        return gen

    def _format(self, x: torch.Tensor) -> torch.memory_format:
        """The memory format asked for, in its 5-D spelling for clips (N, C, T, H, W)."""
        if x.dim() == 5 and self.memory_format == torch.channels_last:
            return torch.channels_last_3d
        if x.dim() != 4 and self.memory_format != torch.contiguous_format:
            return torch.contiguous_format  # (no channels-last layout of other ranks)
        return self.memory_format

    def _augment(self, images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        if self.device_augment is not None:
            images = self.device_augment(images, gen)
        n, _, h, w = images.shape
        dev = images.device
        if self.shift:
            s = self.shift
            padded = F.pad(images, (s, s, s, s))
            dy = torch.randint(0, 2 * s + 1, (n, 1), generator=gen, device=dev)
            dx = torch.randint(0, 2 * s + 1, (n, 1), generator=gen, device=dev)
            rows = (dy + torch.arange(h, device=dev))[:, :, None]
            cols = (dx + torch.arange(w, device=dev))[:, None, :]
            batch = torch.arange(n, device=dev)[:, None, None]
            images = padded[batch, :, rows, cols].permute(0, 3, 1, 2)  # [N,H,W,C] -> [N,C,H,W]
        if self.hflip:
            flip = torch.rand(n, generator=gen, device=dev) < 0.5
            images = torch.where(flip[:, None, None, None], images.flip(3), images)
        return images
