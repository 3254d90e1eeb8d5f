"""The geometry of the image options: resizing, the center crop, the evaluation resize
(shorter side to ``eval_size / crop_pct``, then the center crop) and the random resized crop
with its flip, on the CPU per image or on the device per batch. Pure tensor code, no files:
`dataset=image_folder` and `dataset=streaming` both crop with it (data/images/decode.py draws the
boxes on the whole decoded photo), so the same samples give the same pixels whichever option reads
them.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

RATIO = (3 / 4, 4 / 3)  # aspect ratios of the random resized crop (torchvision's default)
INTERPOLATIONS = ("bilinear", "bicubic")  # dataset.interpolation (timm's pretrained configs')


def resize(img: torch.Tensor, h: int, w: int, mode: str = "bilinear") -> torch.Tensor:
    """uint8 [3, H, W] -> [3, h, w], antialiased ``mode``: the kernel torchvision's ``resize``
    runs for uint8 CPU tensors, called directly (its dispatch costs as much). For a tensor
    whose memory is HWC (a decoded photo) the kernel's channels-last path runs, 2-3x faster
    than PIL's ``resize`` on the same box: 0.34 vs 0.81 ms, 300x280 -> 224, one core)."""
    out = F.interpolate(img[None], size=(h, w), mode=mode, align_corners=False, antialias=True)
    return out[0]


def eval_geometry(height: int, width: int, size: int, resize_to: int) -> tuple[int, int, int, int]:
    """(new_h, new_w, top, left): evaluation's resize of the shorter side to ``resize_to``
    (the longer one truncated, torchvision's ``Resize(resize_to)`` rule) and the offsets of
    its center ``size`` crop (torchvision's ``CenterCrop(size)``)."""
    if height <= width:
        new_h, new_w = resize_to, int(resize_to * width / height)
    else:
        new_h, new_w = int(resize_to * height / width), resize_to
    top = int(round((new_h - size) / 2.0))
    left = int(round((new_w - size) / 2.0))
    return new_h, new_w, top, left


def eval_resize_to(size: int, crop_pct: float) -> int:
    """The shorter side evaluation resizes to before its center crop: ``size / crop_pct``
    rounded down, timm's rule (``math.floor(img_size / crop_pct)``); 224 at 0.875 -> 256."""
    return max(size, math.floor(size / crop_pct))


def view_of(base: torch.Tensor, view: str, crop, size: int, draw: str) -> torch.Tensor:
    """The image a sample shows: a random crop seeded by `draw` (seed/epoch/index, so the same
    sample gets the same crop in every run and process), the center crop, or the base image."""
    if view == "random":
        return crop(base, random.Random(draw))
    if view == "center":
        return center_crop(base, size)
    return base


def center_crop(images: torch.Tensor, size: int) -> torch.Tensor:
    """The center size x size crop of [..., H, W] images (a view), where torchvision's
    ``center_crop`` puts it."""
    top = int(round((images.shape[-2] - size) / 2.0))
    left = int(round((images.shape[-1] - size) / 2.0))
    return images[..., top : top + size, left : left + size]


class RandomResizedCrop:
    """torchvision's RandomResizedCrop (area share in ``scale``, aspect ratio 3/4..4/3, up to
    10 tries, else the whole image) plus a random horizontal flip, drawn from the given
    ``random.Random`` so the caller decides the seed."""

    def __init__(self, size: int, scale: tuple[float, float], hflip: bool, mode: str = "bilinear"):
        self.size, self.scale, self.hflip, self.mode = size, scale, hflip, mode

    def __call__(self, image: torch.Tensor, rng: random.Random) -> torch.Tensor:
        top, left, h, w = self.box(image.shape[-2], image.shape[-1], rng)
        return self.finish(image[:, top : top + h, left : left + w], self.size, rng)

    def finish(self, region: torch.Tensor, size: int, rng: random.Random) -> torch.Tensor:
        """The box's pixels resized to ``size`` and flipped (the flip drawn after the box)."""
        image = resize(region, size, size, self.mode)
        if self.hflip and rng.random() < 0.5:
            image = image.flip(-1)
        return image

    def box(self, height: int, width: int, rng: random.Random) -> tuple[int, int, int, int]:
        """(top, left, h, w) of the crop: torchvision's ``RandomResizedCrop.get_params`` rule,
        draw for draw (area share, then log aspect ratio, up to 10 tries; then the top and the
        left edge), with its fallback: the center crop of the whole image at the nearest
        allowed aspect ratio."""
        area = height * width
        log_lo, log_hi = math.log(RATIO[0]), math.log(RATIO[1])
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            ratio = math.exp(rng.uniform(log_lo, log_hi))
            w = round(math.sqrt(target * ratio))
            h = round(math.sqrt(target / ratio))
            if 0 < w <= width and 0 < h <= height:
                return rng.randint(0, height - h), rng.randint(0, width - w), h, w
        in_ratio = width / height
        if in_ratio < RATIO[0]:
            w, h = width, round(width / RATIO[0])
        elif in_ratio > RATIO[1]:
            w, h = round(height * RATIO[1]), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w


class ResizedRandomCrop:
    """torchvision's video reference's training crop: every frame resized to ``resize``
    (h, w), then a random ``size`` x ``size`` crop (``Resize((128, 171))`` +
    ``RandomCrop(112)``), and a random horizontal flip. Given as the box of the source frame
    that crop shows (``box``), so the CPU and the device paths resize once, as for
    :class:`RandomResizedCrop`."""

    def __init__(self, size: int, resize: tuple[int, int], hflip: bool):
        self.size, self.resize, self.hflip = size, resize, hflip

    def box(self, height: int, width: int, rng: random.Random) -> tuple[int, int, int, int]:
        """(top, left, h, w) in the source frame of the random crop of the resized frame."""
        rh, rw = self.resize
        top, left = rng.randint(0, rh - self.size), rng.randint(0, rw - self.size)
        sy, sx = height / rh, width / rw
        h, w = max(1, round(self.size * sy)), max(1, round(self.size * sx))
        return min(round(top * sy), height - h), min(round(left * sx), width - w), h, w


class DeviceRandomResizedCrop:
    """``Splits.device_augment``: RandomResizedCrop + flip of a whole uint8 batch [N, 3, L, L]
    on its device, in one ``grid_sample`` with a per-sample affine grid (bilinear, no
    antialiasing: the crops shrink by at most L/S ~ 1.14 with the defaults). -> uint8
    [N, 3, S, S]. The boxes are drawn like torchvision's (10 candidates per image, the first
    that fits, else the whole image) from the given generator."""

    TRIES = 10

    def __init__(self, size: int, scale: tuple[float, float], hflip: bool):
        self.size, self.scale, self.hflip = size, scale, hflip

    def __call__(self, images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        n, c, height, width = images.shape
        dev = images.device

        def uniform(*shape, lo=0.0, hi=1.0):
            return torch.empty(shape, device=dev).uniform_(lo, hi, generator=gen)

        area = uniform(n, self.TRIES, lo=self.scale[0], hi=self.scale[1]) * (height * width)
        ratio = uniform(n, self.TRIES, lo=math.log(RATIO[0]), hi=math.log(RATIO[1])).exp()
        w, h = (area * ratio).sqrt(), (area / ratio).sqrt()
        fits = (w <= width) & (h <= height)
        first = fits.int().argmax(1, keepdim=True)  # the first candidate that fits
        ok = fits.any(1)
        w = torch.where(ok, w.gather(1, first).squeeze(1), width)
        h = torch.where(ok, h.gather(1, first).squeeze(1), height)
        left, top = uniform(n) * (width - w), uniform(n) * (height - h)
        flip = uniform(n) < 0.5 if self.hflip else torch.zeros(n, dtype=torch.bool, device=dev)

        # Output coordinates in [-1, 1] -> input coordinates in [-1, 1] (align_corners=False:
        # -1 and 1 are the outer edges of the border pixels).
        theta = torch.zeros(n, 2, 3, device=dev)
        theta[:, 0, 0] = torch.where(flip, -w / width, w / width)
        theta[:, 0, 2] = (2 * left + w) / width - 1
        theta[:, 1, 1] = h / height
        theta[:, 1, 2] = (2 * top + h) / height - 1
        grid = F.affine_grid(theta, [n, c, self.size, self.size], align_corners=False)
        out = F.grid_sample(
            images.float(), grid, mode="bilinear", padding_mode="border", align_corners=False
        )
        return out.round_().clamp_(0, 255).to(torch.uint8)


def crop_resize_each(
    images: list[torch.Tensor], boxes: list[list[int]], size: int, mode: str = "bilinear"
) -> torch.Tensor:
    """uint8 [3, H_i, W_i] images of any sizes (decoded on the device) -> uint8 [N, 3, S, S],
    each by its box [top, left, h, w, flip, resize_h, resize_w]: resized whole to (resize_h,
    resize_w) first when resize_h > 0 (evaluation's shorter-side resize), the box cut out and
    resized to ``size`` (antialiased, in float: the device kernels' dtype), flipped where flip
    is 1. The geometry of the CPU path (data/images/decode.py), rounded once at the end instead of
    after each resize. The boxes are host lists (drawn in the loader workers as for the CPU
    path), so nothing here waits for the device."""
    out = torch.empty(len(images), 3, size, size, dtype=torch.uint8, device=images[0].device)
    for i, (image, box) in enumerate(zip(images, boxes, strict=True)):
        top, left, h, w, flip, resize_h, resize_w = box
        x = image[None].float()
        if resize_h:
            x = F.interpolate(x, size=(resize_h, resize_w), mode=mode, antialias=True)
        x = x[..., top : top + h, left : left + w]
        if (h, w) != (size, size):
            x = F.interpolate(x, size=(size, size), mode=mode, antialias=True)
        x = x[0].round_().clamp_(0, 255)
        out[i] = x.flip(-1) if flip else x
    return out
