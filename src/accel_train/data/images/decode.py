"""One image file -> the uint8 pixels a sample shows, with as little decoding as its crop
allows; and the check of every file's header before anything is trained or written.

Per sample (``dataset=image_folder`` without a cache, ``dataset=streaming``): the header gives
the size, the crop box is drawn on the whole image (data/crops.py, torchvision's rule),
and when the box's shorter side is at least twice the output's, libjpeg-turbo decodes at 1/2,
1/4 or 1/8 scale in its DCT, with the box scaled alike. The box is then resized to the output
size by torch's uint8 antialiased kernel on the HWC pixels (its channels-last path: 2-3x
faster than PIL's resize), flipped, and handed on as uint8 ``[3, S, S]``; floats only ever
exist on the device (data/transform.py normalises there).

Two decoders, the same pixels. JPEGs go through simplejpeg (the ``vision`` extra: a thin
binding of libjpeg-turbo) when it is installed: its header read is C, it decodes straight into
a numpy array, and with the same flags its pixels equal PIL's bit for bit (both are
libjpeg-turbo; tests/test_vision_pipeline.py checks it at full and reduced scale, fast and
accurate). Everything else (PNG, a grayscale or CMYK JPEG, a file simplejpeg refuses, no
simplejpeg) takes PIL's path, whose refusals and messages are the only ones a user sees.
Measured (scripts/bench/image_loader.py's rows (e), BENCHMARKS.md section 29b: 2,000 photo-like
JPEGs of ~79 KB, ~480x370, one core of the 2-core Xeon): the whole per-sample path (header,
box, decode, crop and resize, flip) takes 1.14 ms through simplejpeg against 1.54 ms through
PIL, whose Python-side open and load and the copy out of its buffer cost the difference;
PyTorch's ImageNet example spends 2.18 ms on the same sample. Such files spend most of their
decode in entropy decoding, which no DCT scaling skips (half scale: 1.70 vs 1.77 ms).
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

from accel_train.data.crops import RandomResizedCrop, eval_geometry, resize
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
SCAN_CHUNK = 64  # files a thread checks per task
HEADER_BYTES = 65_536  # read for simplejpeg's header check (an APP segment is at most 64 KB)
# A JPEG's last bytes, read to find its EOI marker (a truncated file has none): 4 KB covers the
# padding some writers add after it; a longer trailer costs a read from the scan on.
TAIL_BYTES = 4096
SHOWN = 50  # bad files named in the refusal itself; more are listed in the log, one a line
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
    # A thread takes SCAN_CHUNK files at a time: one future per file cost more than the
    # headers (their locks: 0.12 of 0.19 s for 2,000 files).
    chunks = [paths[i : i + SCAN_CHUNK] for i in range(0, len(paths), SCAN_CHUNK)]
    with ThreadPoolExecutor(min(SCAN_THREADS, max(1, len(chunks)))) as pool:
        done = pool.map(_check_chunk, chunks, [jpeg_only] * len(chunks))
        return [p for chunk in done for p in chunk]


def _check_chunk(paths: list[str], jpeg_only: bool) -> list:
    return [_check_one(p, jpeg_only) for p in paths]


def _check_one(path: str, jpeg_only: bool) -> tuple[str, str, str] | None:
    """(kind, path, message) of one file's problem, None when it is fine. The header, and for
    a JPEG its end: simplejpeg's header read for a colour JPEG (nothing to refuse there), else
    PIL's."""
    head = _jpeg_head(path)
    if head is not None and not _jpeg_ends(path, head):
        return "truncated", path, (
            f"the image file {path} is truncated: its JPEG data stops before the end-of-image "
            "marker (an interrupted copy or download), and decoding it would stop training. "
            "Delete or replace it (or re-download the data set)"
        )  # fmt: skip
    if head is not None and _jpeg(head) is not None:
        return None
    try:
        with _pil().open(path) as im:
            problem = header_problem(im, path, jpeg_only)
    except (OSError, SyntaxError, ValueError) as err:
        return "unreadable", path, str(unreadable(err, f"the image file {path}"))
    return None if problem is None else ("mode", path, problem)


def _jpeg_head(path: str) -> bytes | None:
    """The first HEADER_BYTES of a JPEG file (None: not a JPEG, or unreadable: PIL's open then
    reports it). Two bytes first: PIL reads a PNG itself, once."""
    try:
        with open(path, "rb") as f:
            data = f.read(2)
            return data + f.read(HEADER_BYTES - 2) if data == JPEG_START else None
    except OSError:
        return None


def _scan_start(head: bytes) -> int | None:
    """Where the first scan's entropy-coded data starts (after the SOS segment), from the
    marker segments of the file's head; None when it is not in ``head`` (e.g. APP segments
    longer than HEADER_BYTES) or the segments are malformed (then the decoder decides)."""
    at = 2
    while at + 4 <= len(head):
        if head[at] != 0xFF:
            return None
        marker = head[at + 1]
        if marker == 0xFF:  # a fill byte before the marker
            at += 1
            continue
        if marker in STANDALONE_MARKERS:
            at += 2
            continue
        length = int.from_bytes(head[at + 2 : at + 4], "big")
        if marker == SOS:
            return at + 2 + length
        at += 2 + length
    return None


def _jpeg_ends(path: str, head: bytes) -> bool:
    """Whether the JPEG's data ends with its EOI marker (FF D9) somewhere after the first
    scan's start: entropy-coded data never holds FF D9 (a data FF is stuffed as FF 00), so a
    truncated file has none there. Bytes after EOI (padding, a camera's trailer, a motion
    photo's video) are ignored, as libjpeg and PIL ignore them. The last TAIL_BYTES are read
    (one seek); a file whose EOI is further back is read from its scan on (rare: trailers)."""
    start = _scan_start(head)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            tail_at = max(size - TAIL_BYTES, start or 0)
            f.seek(tail_at)
            if JPEG_END in f.read():
                return True
            if start is None or start >= tail_at:
                return start is None  # the head was not parsed: the decoder decides
            f.seek(start)
            return JPEG_END in f.read(tail_at - start + 1)  # (+1: a marker across the seam)
    except OSError:
        return True  # PIL's open reports it, with the path


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
        # Every bad file at once, not one per attempt: the first in full, the others by path
        # (past SHOWN, in the log, one line each), each with its kind of problem.
        others = [f"{path} ({kind})" for kind, path, _ in found[1:]]
        if len(others) > SHOWN and log is not None:
            for line in others:
                log.error("bad image: %s", line)
        listed = "; ".join(others[:SHOWN])
        rest = (
            f"; and {len(others) - SHOWN} more, each in the log above"
            if len(others) > SHOWN
            else ""
        )
        more = (
            f" {len(found) - 1} other file(s) cannot be read as RGB either: {listed}{rest}. "
            "Fix or replace them alike (ImageMagick's `mogrify` takes many files at once)."
        )
    skip = " (`dataset.check_images=false` skips this check; a bad file then stops training)."
    raise UserError(f"dataset.root: {first.rstrip('.')}.{more}{skip}")


# ---- decoding a sample --------------------------------------------------------------------


def dct_scale(im, shorter: float, needed: int) -> int:
    """The libjpeg scale (8, 4, 2; 1 = none) that keeps ``shorter`` (the box's shorter side)
    at least ``needed`` pixels; only JPEGs scale."""
    return jpeg_scale(shorter, needed) if im.format == "JPEG" else 1


def jpeg_scale(shorter: float, needed: float) -> int:
    """The largest libjpeg scale (8, 4, 2; else 1) that keeps ``shorter`` >= ``needed``."""
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


# ---- the JPEG fast path: simplejpeg, the same pixels as PIL's ----------------------------------

_SIMPLEJPEG = []  # [module or None], imported once per process
JPEG_START = b"\xff\xd8"  # a JPEG file's first two bytes (its SOI marker)
JPEG_END = b"\xff\xd9"  # its EOI marker, after the last scan
SOS = 0xDA  # the start-of-scan marker: its segment is followed by the entropy-coded data
STANDALONE_MARKERS = frozenset([0x01, *range(0xD0, 0xD9)])  # TEM, RSTn, SOI: no length field


def _simplejpeg():
    if not _SIMPLEJPEG:
        try:
            import simplejpeg
        except ImportError:  # the vision extra is not installed: PIL decodes everything
            simplejpeg = None
        _SIMPLEJPEG.append(simplejpeg)
    return _SIMPLEJPEG[0]


def _jpeg(source: str | bytes, limit: int = -1) -> tuple[bytes, int, int] | None:
    """(bytes, height, width) of a colour JPEG that simplejpeg can take (``limit``: read at
    most that many bytes of a file); None sends the file to PIL's path (another format,
    grayscale, CMYK, a header simplejpeg refuses, or no simplejpeg): PIL's path then decodes
    it or refuses it with its one message."""
    sj = _simplejpeg()
    if sj is None:
        return None
    if isinstance(source, str):
        try:
            with open(source, "rb") as f:
                data = f.read(2)  # the rest only for a JPEG: PIL reads a PNG itself, once
                if data != JPEG_START:
                    return None
                data += f.read(limit - 2 if limit > 0 else -1)
        except OSError:
            return None  # PIL's open reports it, with the path
    elif source[:2] != JPEG_START:
        return None
    else:
        data = source
    try:
        height, width, colorspace, _ = sj.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in ("YCbCr", "RGB"):
        return None
    return data, height, width


def _jpeg_pixels(data: bytes, height: int, width: int, scale: int, fast: bool):
    """simplejpeg's decode at 1/``scale`` with PIL's flags (``fast``: the fastest IDCT and
    plain chroma upsampling, :func:`load_rgb`'s): uint8 HWC, or None where it refuses the
    data (PIL's path then decides, with its own message)."""
    try:
        return _simplejpeg().decode_jpeg(
            data,
            fastdct=fast,
            fastupsample=fast,
            min_height=-(-height // scale),
            min_width=-(-width // scale),
        )
    except ValueError:
        return None


def decode_train(
    source: str | bytes, what: str, crop: RandomResizedCrop, size: int, rng
) -> torch.Tensor:
    """A training sample: torchvision's random resized crop of the whole photo to ``size``,
    then the flip, both drawn from ``rng``; uint8 [3, size, size]."""
    jpeg = _jpeg(source)
    if jpeg is not None:
        data, height, width = jpeg
        state = rng.getstate()  # a refused decode retakes PIL's path with the same draws
        box = crop.box(height, width, rng)
        scale = jpeg_scale(min(box[2], box[3]), size)
        pixels = _jpeg_pixels(data, height, width, scale, fast=True)
        if pixels is not None:
            return crop.finish(_region(pixels, box, scale), size, rng)
        rng.setstate(state)
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
    jpeg, pixels = _jpeg(source), None
    if jpeg is not None:
        data, height, width = jpeg
        new_h, new_w, top, left = eval_geometry(height, width, size, resize_to)
        scale = jpeg_scale(min(height / new_h, width / new_w), 1)
        pixels = _jpeg_pixels(data, height, width, scale, fast=False)
    if pixels is None:
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
    resize_h, resize_w] (resize_h = 0: no resize before the crop; data/crops.py's
    crop_resize_each)."""
    jpeg = _jpeg(data)  # simplejpeg's header read (C) when it takes the file, else PIL's
    if jpeg is not None:
        _, height, width = jpeg
    else:
        with open_image(data, what) as im:
            width, height = im.size
    if crop is not None:
        top, left, h, w = crop.box(height, width, rng)
        flip = int(crop.hflip and rng.random() < 0.5)
        return [top, left, h, w, flip, 0, 0]
    new_h, new_w, top, left = eval_geometry(height, width, size, resize_to)
    return [top, left, size, size, 0, new_h, new_w]
