"""Photos at full size: the splits of ``dataset=image_folder`` without a cache, each sample
decoded from its whole file (data/images/decode.py), as torchvision's and timm's loaders read them.

Training items are a random resized crop of the whole photo (area share ``crop_scale``,
aspect ratio 3/4..4/3) resized to the training size, then a random flip, seeded by
(seed, epoch, index): the batches do not depend on the number of workers or on a resume.
Evaluation items resize the shorter side to ``eval_size / crop_pct`` and take the center crop.
Both are uint8 ``[3, S, S]``; the device normalises them.

Two hooks for the per-sample path: ``size_at`` (epoch -> training size: progressive resizing)
and ``sample_augment`` (data/images/decode.py's SampleAugment: RandAugment and the like, after the
crop and flip, from the same seeded ``random.Random``). Both must be set before the loader
starts its workers (they are pickled with the split).

``decode="gpu"``: items are the file's bytes and the box drawn from its header, exactly as for
the CPU (data/images/decode.py header_box); :class:`EncodedCollate` packs a batch into one
:class:`EncodedBatch`, which stays on the host (nvJPEG reads host memory) until the device
transform calls its ``decode_on``: torchvision's batched ``decode_jpeg(device="cuda")``, then
the crops and flips (data/crops.py crop_resize_each).
"""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from accel_train.data.crops import RandomResizedCrop, crop_resize_each
from accel_train.data.images.decode import SampleAugment, decode_eval, decode_train, header_box


class Files:
    """The files of one folder by index. One numpy bytes array rather than a list of str:
    DataLoader workers are forked, and reading Python objects touches their refcounts,
    copying the pages into every worker."""

    def __init__(self, folder: os.PathLike | str, files: list[str]):
        self.folder = str(folder)
        self._files = np.array([os.fsencode(f) for f in files])

    def __len__(self) -> int:
        return len(self._files)

    def path(self, j: int) -> str:
        return os.path.join(self.folder, os.fsdecode(self._files[j]))


class PhotoSplit(Dataset):
    """Items ``(uint8 [3, S, S], label)`` decoded from whole files: a random resized crop
    (``crop`` given: training) or the evaluation resize and center crop (``crop`` None)."""

    def __init__(
        self,
        files: Files,
        indices: torch.Tensor,
        all_labels: torch.Tensor,
        *,
        size: int,
        resize_to: int,
        crop: RandomResizedCrop | None = None,
        seed: int = 0,
        mode: str = "bilinear",
        decode: str = "cpu",
    ):
        self.files, self.indices, self.size, self.resize_to = files, indices, size, resize_to
        self.crop, self.seed, self.mode, self.decode = crop, seed, mode, decode
        self.labels = all_labels[indices]  # int64 [N]: the labels without reading any image
        # Hooks for the per-sample path (see the module docstring).
        self.size_at: Callable[[int], int] | None = None
        self.sample_augment: SampleAugment | None = None
        if decode == "gpu":
            self.collate = EncodedCollate(mode)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.getitem(i, 0)

    def path(self, i: int) -> str:
        """Item i's source file (accel-eval's predictions name it)."""
        return self.files.path(int(self.indices[i]))

    def getitem(self, i: int, epoch: int):
        path = self.path(i)
        what = f"dataset.root: the image file {path}"
        size = self.size_at(epoch) if self.size_at is not None and self.crop else self.size
        rng = random.Random(f"{self.seed}/{epoch}/{i}")
        if self.decode == "gpu":
            with open(path, "rb") as f:
                data = f.read()
            box = header_box(data, what, self.crop, size, self.resize_to, rng)
            encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return (encoded, torch.tensor([*box, size])), int(self.labels[i])
        if self.crop is None:
            image = decode_eval(path, what, self.size, self.resize_to, self.mode)
        else:
            image = decode_train(path, what, self.crop, size, rng)
            if self.sample_augment is not None:
                image = self.sample_augment(image, rng)
        return image, int(self.labels[i])

    def __repr__(self) -> str:
        kind = "random crops" if self.crop else "center crops"
        return f"{type(self).__name__}({len(self)} images of {self.files.folder}, {kind})"


class EncodedBatch:
    """A batch of encoded JPEGs (one flat uint8 host tensor and each file's length) and each
    sample's box [top, left, h, w, flip, resize_h, resize_w] (data/images/decode.py header_box). Not
    a tensor: the loader neither pins it nor moves it (nvJPEG copies the bytes itself;
    pinning hundreds of small buffers costs more than it saves). ``decode_on`` gives the
    uint8 [N, 3, S, S] batch."""

    def __init__(self, flat, lengths: list[int], boxes: list[list[int]], size: int, mode: str):
        self.flat, self.lengths, self.boxes, self.size, self.mode = flat, lengths, boxes, size, mode

    def pin_memory(self) -> EncodedBatch:
        return self  # the DataLoader's pin thread asks; see the class docstring

    def __len__(self) -> int:
        return len(self.lengths)

    def decode_on(self, device: torch.device) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_jpeg

        files = list(torch.split(self.flat, self.lengths))
        with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders (TorchCodec)
            warnings.simplefilter("ignore", DeprecationWarning)
            # One batched nvJPEG call on CUDA (libjpeg-turbo on the CPU, for the tests).
            # torchvision decodes on a stream of its own, orders it with the current one by
            # events, and parses the headers on the host (nvJPEG's hybrid stage): the host may
            # wait here for that stage, not for the training step's kernels. Unmeasured without
            # a GPU: scripts/gpu_check.sh logs the data-wait share of decode=gpu.
            images = decode_jpeg(files, mode=ImageReadMode.RGB, device=device)
        return crop_resize_each(images, self.boxes, self.size, self.mode)


class EncodedCollate:
    """``decode="gpu"`` items ((bytes, box + [size]), label) -> (EncodedBatch, int64 labels)."""

    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, items: list) -> tuple[EncodedBatch, torch.Tensor]:
        encoded = [x[0] for x, _ in items]
        boxes = torch.stack([x[1] for x, _ in items]).tolist()
        labels = torch.tensor([int(y) for _, y in items], dtype=torch.int64)
        size = boxes[0][-1]
        batch = EncodedBatch(
            torch.cat(encoded), [len(e) for e in encoded], [b[:-1] for b in boxes], size, self.mode
        )
        return batch, labels
