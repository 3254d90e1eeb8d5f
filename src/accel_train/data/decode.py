"""One image file -> the uint8 pixels a sample shows, with as little decoding as its crop
allows; and the check of every file's header before anything is trained or written.

Per sample (``dataset=image_folder`` without a cache, ``dataset=streaming``): PIL's lazy open
reads the header only (mode and size), the crop box is drawn on the whole image
(data/image_crops.py, torchvision's rule), and when the box's shorter side is at least twice
the output's, libjpeg-turbo decodes at 1/2, 1/4 or 1/8 scale in its DCT (PIL's ``draft``),
with the box scaled alike. The box is then resized to the output size by torch's uint8
antialiased kernel on the HWC pixels (its channels-last path: 2-3x faster than PIL's resize),
flipped, and handed on as uint8 ``[3, S, S]``; floats only ever exist on the device
(data/transform.py normalises there).

The decoder, measured (200 photo-like JPEGs of ~78 KB, 536x389, one core of the shared 2-core
Xeon, CPU seconds, median of 5 passes): a whole decode takes 1.77 ms with PIL, 1.72 ms with
simplejpeg's ``fastdct=True`` (1.62 ms adding ``fastupsample``); decoding at half scale 1.70
vs 1.50 ms (such files spend most of their time in entropy decoding, which no scaling skips);
the whole per-sample path (header, box, decode, crop and resize, flip) 315 vs 339 images/s.
PIL stays: simplejpeg's 7 % would add a dependency and a second decoder whose fast-DCT pixels
differ from PIL's, so a run's pixels would depend on what is installed; PIL also reads PNG in
the same code, and torchvision depends on it already.
"""

from __future__ import annotations

import io
import os
import random
import re
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from accel_train.data.image_crops import RandomResizedCrop, eval_geometry, resize
from accel_train.errors import UserError

DCT_SCALES = (8, 4, 2)  # the reduced sizes libjpeg decodes to (PIL's draft picks among them)
# The header check: PIL parses headers in Python, ~0.15 ms a file from the page cache (2,000
# files in 0.30 s on one core of the shared Xeon; ImageNet's 1.28 M files would take ~3 min).
# Up to SCAN_PROCESSES forked processes share a large folder (ImageNet: ~25 s on 8 cores,
# extrapolated); a small one is read by SCAN_THREADS threads, which add no CPU (the GIL) but
# overlap a network file system's latency (ms per open).
SCAN_THREADS = 8
SCAN_PROCESSES = 8
SCAN_PROCESSES_FROM = 20_000  # files; below, starting processes costs more than it saves
SHOWN = 3  # files named in a refusal (with the count of the others)
# np.asarray(PIL image) is a read-only view of PIL's bytes, which torch.from_numpy warns about
# once per process; the tensors made of it here are only ever read (resized into new ones).
warnings.filterwarnings(
    "ignore", "The given NumPy array is not writable", UserWarning, r"accel_train\.data\.decode"
)


class UnreadableImageError(UserError):
    """An image file that does not decode (UserError keeps its message one paragraph when a
    loader worker raised it)."""


def unreadable(err: BaseException, what: str) -> UnreadableImageError:
    # torchvision's message starts with its C++ source location: keep the reason only.
    text = str(err).strip() or type(err).__name__
    reason = re.sub(r"^.*?\.cpp:\d+, ", "", text.splitlines()[0])
    return UnreadableImageError(
        f"{what} is corrupt or unreadable ({reason}). Delete or replace that file (or "
        "re-download the data set)."
    )


def _pil():
    # PIL is imported where images are read (the workers, the header scan), not at start-up.
    from PIL import Image

    return Image


def open_image(source: str | bytes, what: str):
    """PIL's lazy open of a file path or of encoded bytes: the header is read, no pixel."""
    Image = _pil()
    try:
        return Image.open(source if isinstance(source, str) else io.BytesIO(source))
    except (OSError, SyntaxError, ValueError) as err:
        raise unreadable(err, what) from err


# ---- what an RGB set refuses, from the header alone ---------------------------------------

GRAY_MODES = ("1", "L", "I", "I;16", "I;16B", "I;16L", "F")


def header_problem(im, path: str, jpeg_only: bool = False) -> str | None:
    """Why a lazily opened image cannot join an RGB set (None: it can): a sentence that starts
    with ``path`` and ends with the fix, a one-line command."""
    q = f"'{path}'"
    pil_rgb = f"`python -c \"from PIL import Image; Image.open({q}).convert('RGB').save({q})\"`"
    mode, fmt = im.mode, im.format or "?"
    if jpeg_only and fmt != "JPEG":
        return (
            f"{path} is a {fmt}, and dataset.decode=gpu decodes JPEGs only (nvJPEG). Convert it "
            f"to JPEG (`magick {q} -quality 95 <name>.jpg`, then remove the {fmt}) or use "
            "`dataset.decode=cpu`"
        )
    if mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in im.info:
        return (
            f"{path} has an alpha channel (mode {mode}"
            f"{' with a transparent colour' if 'transparency' in im.info else ''}): what shows "
            "through its transparent pixels is undefined. Flatten it onto a background: "
            f"`magick {q} -background white -alpha remove -alpha off {q}` (ImageMagick), or "
            f"`python -c \"from PIL import Image; im = Image.open({q}).convert('RGBA'); "
            f"bg = Image.new('RGB', im.size, 'white'); bg.paste(im, mask=im.getchannel('A')); "
            f'bg.save({q})"`'
        )
    if mode == "CMYK":
        return (
            f"{path} is a CMYK {fmt} (print colours), which decoders turn into RGB differently. "
            f"Convert it to sRGB: `magick {q} -colorspace sRGB -type TrueColor {q}` "
            f"(ImageMagick, which applies the file's colour profile), or {pil_rgb}"
        )
    if mode in GRAY_MODES:
        return (
            f"{path} is grayscale (mode {mode}) in a set read as RGB (3 channels). Convert it "
            f"to RGB: `magick {q} -type TrueColor {q}` (ImageMagick), or {pil_rgb}"
        )
    if mode not in ("RGB", "P"):
        return f"{path} has the pixel mode {mode}, not RGB. Convert it: {pil_rgb}"
    return None


def _scan(paths: list[str], jpeg_only: bool) -> list:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    procs = min(SCAN_PROCESSES, cpus or 1)
    if len(paths) >= SCAN_PROCESSES_FROM and procs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        chunks = [paths[i : i + 2048] for i in range(0, len(paths), 2048)]
        context = multiprocessing.get_context("fork")  # nothing to import again
        with ProcessPoolExecutor(procs, mp_context=context) as pool:
            done = pool.map(_check_chunk, chunks, [jpeg_only] * len(chunks))
            return [p for chunk in done for p in chunk]
    with ThreadPoolExecutor(min(SCAN_THREADS, max(1, len(paths) // 64))) as pool:
        return list(pool.map(lambda p: _check_one(p, jpeg_only), paths))


def _check_chunk(paths: list[str], jpeg_only: bool) -> list:
    return [_check_one(p, jpeg_only) for p in paths]


def _check_one(path: str, jpeg_only: bool) -> tuple[str, str, str] | None:
    """(kind, path, message) of one file's problem, None when it is fine. The header only."""
    try:
        with _pil().open(path) as im:
            problem = header_problem(im, path, jpeg_only)
    except (OSError, SyntaxError, ValueError) as err:
        return "unreadable", path, str(unreadable(err, f"the image file {path}"))
    return None if problem is None else ("mode", path, problem)


def check_images(paths: Sequence[str], jpeg_only: bool = False, log=None) -> None:
    """Every file's header (threads, or processes for a large folder: see SCAN_THREADS): one
    UserError naming the first files that are unreadable, CMYK, transparent, grayscale or
    (``jpeg_only``) not JPEG, with the fix, before anything is trained or written.
    ``dataset.check_images=false`` skips it (a huge folder checked once already)."""
    start = time.perf_counter()
    found = [p for p in _scan(list(paths), jpeg_only) if p]
    if log is not None:
        log.info("checked %d image headers in %.2f s", len(paths), time.perf_counter() - start)
    if not found:
        return
    kind, _, first = found[0]
    more = ""
    if len(found) > 1:
        names = ", ".join(os.path.basename(path) for _, path, _ in found[1:SHOWN])
        more = (
            f" {len(found) - 1} other file(s) cannot be read as RGB either (e.g. {names}): "
            "convert them alike (ImageMagick's `mogrify` takes many files at once)."
        )
    skip = " (`dataset.check_images=false` skips this check; a bad file then stops training)."
    raise UserError(f"dataset.root: {first.rstrip('.')}.{more}{skip}")


# ---- decoding a sample --------------------------------------------------------------------


def dct_scale(im, shorter: float, needed: int) -> int:
    """The libjpeg scale (8, 4, 2; 1 = none) that keeps ``shorter`` (the box's shorter side)
    at least ``needed`` pixels; only JPEGs scale."""
    if im.format != "JPEG":
        return 1
    return next((s for s in DCT_SCALES if shorter >= s * needed), 1)


def load_rgb(im, scale: int, what: str, name: str, fast: bool = False) -> np.ndarray:
    """uint8 HWC pixels of a lazily opened image, decoded at 1/``scale`` (JPEG DCT scaling).
    ``fast``: libjpeg's fastest IDCT and plain chroma upsampling (PIL's draft-mode flag):
    decoding takes 2.0-2.2 ms instead of 2.4-2.5 ms for the photos measured above, and the
    pixels are within 37 dB PSNR of the accurate decode (what simplejpeg's fastdct and
    fastupsample give); training samples use it, evaluation decodes accurately.
    A file the header check would refuse (with dataset.check_images=false) stops here, named
    ``name`` (its path, or ``what`` for bytes read from shards)."""
    problem = header_problem(im, name) if im.mode != "RGB" else None
    if problem is not None:
        raise UserError(f"{what}: {problem}.")
    try:
        if scale > 1:
            w, h = im.size
            im.draft("RGB", (w // scale, h // scale))  # W // (W // s) == s: exactly scale s
        if fast and im.format == "JPEG":
            im.decoderconfig = (scale, 1)  # (scale, draft): the decoder's arguments
        im.load()
        return np.asarray(im.convert("RGB") if im.mode != "RGB" else im)
    except (OSError, SyntaxError, ValueError) as err:
        raise unreadable(err, what) from err


def _region(pixels: np.ndarray, box: tuple[int, int, int, int], scale: int) -> torch.Tensor:
    """The box (full-size coordinates) of pixels decoded at 1/scale, as uint8 [3, h, w] whose
    memory is contiguous HWC (the resize kernel's channels-last path: 0.42 ms for 300x280 ->
    224 against 0.58 ms from a strided view and 0.95 ms from CHW)."""
    top, left, h, w = box
    if scale > 1:  # the same region on the reduced grid: each edge within half a pixel of it
        bottom = min(round((top + h) / scale), pixels.shape[0])
        right = min(round((left + w) / scale), pixels.shape[1])
        top, left = min(round(top / scale), bottom - 1), min(round(left / scale), right - 1)
        h, w = bottom - top, right - left
    return torch.from_numpy(np.ascontiguousarray(pixels[top : top + h, left : left + w])).permute(
        2, 0, 1
    )


def _name(source: str | bytes, what: str) -> str:
    return source if isinstance(source, str) else "the image"


# A per-sample augmentation after the crop (RandAugment, TrivialAugment: dataset.auto_augment):
# the cropped, flipped uint8 [3, S, S] image and the sample's seeded random.Random (already
# used for the crop and the flip) -> the image. It runs in the loader workers.
SampleAugment = Callable[[torch.Tensor, random.Random], torch.Tensor]


def decode_train(
    source: str | bytes, what: str, crop: RandomResizedCrop, size: int, rng
) -> torch.Tensor:
    """A training sample: torchvision's random resized crop of the whole photo to ``size``,
    then the flip, both drawn from ``rng``; uint8 [3, size, size]."""
    with open_image(source, what) as im:
        width, height = im.size
        box = crop.box(height, width, rng)
        scale = dct_scale(im, min(box[2], box[3]), size)
        pixels = load_rgb(im, scale, what, _name(source, what), fast=True)
    return crop.finish(_region(pixels, box, scale), size, rng)


def decode_eval(
    source: str | bytes, what: str, size: int, resize_to: int, mode: str = "bilinear"
) -> torch.Tensor:
    """An evaluation sample: the shorter side resized to ``resize_to``, the center ``size``
    crop (torchvision's Resize + CenterCrop; bit for bit at full scale). uint8 [3, size, size]."""
    with open_image(source, what) as im:
        width, height = im.size
        new_h, new_w, top, left = eval_geometry(height, width, size, resize_to)
        scale = dct_scale(im, min(height / new_h, width / new_w), 1)
        pixels = load_rgb(im, scale, what, _name(source, what))
    image = torch.from_numpy(pixels).permute(2, 0, 1)
    if image.shape[1:] != (new_h, new_w):
        image = resize(image, new_h, new_w, mode)
    return image[:, top : top + size, left : left + size].clone()


def header_box(
    data: bytes, what: str, crop: RandomResizedCrop | None, size: int, resize_to: int, rng
) -> list[int]:
    """``dataset.decode=gpu``: what the device needs besides the bytes, drawn from the header
    exactly as :func:`decode_train` / :func:`decode_eval` draw it: [top, left, h, w, flip,
    resize_h, resize_w] (resize_h = 0: no resize before the crop; data/image_crops.py's
    crop_resize_each)."""
    with open_image(data, what) as im:
        width, height = im.size
    if crop is not None:
        top, left, h, w = crop.box(height, width, rng)
        flip = int(crop.hflip and rng.random() < 0.5)
        return [top, left, h, w, flip, 0, 0]
    new_h, new_w, top, left = eval_geometry(height, width, size, resize_to)
    return [top, left, size, size, 0, new_h, new_w]
