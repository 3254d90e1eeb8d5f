"""The geometry of a video clip, in time and space: which frames a clip takes, and how its frames
are cropped. Pure tensor code, no files (data/video/folder.py reads them): the same on the CPU
in the loader workers and on the device (``dataset.decode=gpu``).

Time. A clip is ``frames`` frames ``step`` source frames apart (``frame_stride``, or the source
fps over ``dataset.fps``), spanning ``(frames - 1) * step + 1`` source frames of the video's
window (all of it, or a list file's ``start``..``end``). Training draws its first frame
uniformly; evaluation takes ``clips`` windows spread uniformly from the first possible start to
the last (torchvision's reference ``clips_per_video``). A window shorter than a clip, allowed
with ``pad_short``, gives evenly spaced frames of the whole window, some repeated.

Space. Training: one random resized crop box (torchvision's rule, data/crops.py) and one
flip drawn per clip and applied to every frame, so the motion inside the clip is untouched.
Evaluation: the shorter side resized to ``resize_to``, then ``crops`` crops of ``size`` spread
along the longer side (1: the center crop; 3: both ends and the center, the multi-view test of
SlowFast and pytorchvideo).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from accel_train.data.crops import eval_geometry


@dataclass(frozen=True)
class Timing:
    """A clip's length in frames and the spacing of its frames: ``stride`` source frames, or
    the source fps over ``fps`` when ``fps`` is set."""

    frames: int
    stride: int = 1
    fps: float | None = None

    def step(self, source_fps: float) -> float:
        if self.fps and source_fps > 0:
            return source_fps / self.fps
        return float(self.stride)

    def span(self, source_fps: float) -> int:
        """Source frames one clip covers."""
        return math.floor((self.frames - 1) * self.step(source_fps)) + 1

    def indices(self, start: int, source_fps: float) -> list[int]:
        step = self.step(source_fps)
        return [start + math.floor(k * step) for k in range(self.frames)]

    def padded(self, first: int, available: int) -> list[int]:
        """A window shorter than a clip: ``frames`` evenly spaced frames of it (repeats)."""
        if self.frames == 1:
            return [first]
        return [first + (k * (available - 1)) // (self.frames - 1) for k in range(self.frames)]

    def train_clip(self, first: int, last: int, fps: float, rng: random.Random) -> list[int]:
        """A random clip of the window [first, last)."""
        span = self.span(fps)
        if span > last - first:
            return self.padded(first, last - first)
        return self.indices(rng.randint(first, last - span), fps)

    def eval_clips(self, first: int, last: int, fps: float, clips: int) -> list[list[int]]:
        """``clips`` clips spread uniformly over [first, last) (one: the center)."""
        span = self.span(fps)
        room = last - first - span
        if room < 0:
            return [self.padded(first, last - first)] * clips
        if clips == 1:
            return [self.indices(first + room // 2, fps)]
        return [self.indices(first + round(j * room / (clips - 1)), fps) for j in range(clips)]


def resize_frames(frames: torch.Tensor, h: int, w: int, mode: str = "bilinear") -> torch.Tensor:
    """uint8 (T, C, H, W) -> (T, C, h, w), antialiased (torchvision's kernel, as for images);
    floats on a device (a CUDA decode), rounded back to uint8."""
    if frames.shape[-2:] == (h, w):
        return frames
    if frames.device.type == "cpu":
        return F.interpolate(frames, size=(h, w), mode=mode, align_corners=False, antialias=True)
    out = F.interpolate(frames.float(), size=(h, w), mode=mode, align_corners=False, antialias=True)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def train_view(region: torch.Tensor, size: int, flip: bool) -> torch.Tensor:
    """uint8 (T, C, h, w), every frame cut by the same random resized crop box (drawn by
    data/crops.py's RandomResizedCrop.box, then the flip, as for images) -> (T, C, S, S),
    flipped when ``flip``."""
    out = resize_frames(region, size, size)
    return out.flip(-1) if flip else out


def eval_views(frames: torch.Tensor, size: int, resize_to: int, crops: int) -> torch.Tensor:
    """uint8 (T, C, H, W) -> (crops, T, C, S, S): the shorter side resized to ``resize_to``,
    then ``crops`` crops spread along the longer side."""
    new_h, new_w, top, left = eval_geometry(frames.shape[-2], frames.shape[-1], size, resize_to)
    resized = resize_frames(frames, new_h, new_w)
    if crops == 1:
        return resized[None, ..., top : top + size, left : left + size]
    views = []
    for j in range(crops):
        if new_h > new_w:  # portrait: crops along the height
            y, x = round(j * (new_h - size) / (crops - 1)), left
        else:
            y, x = top, round(j * (new_w - size) / (crops - 1))
        views.append(resized[..., y : y + size, x : x + size])
    return torch.stack(views)
