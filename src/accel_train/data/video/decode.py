"""Video decoding through torchcodec (FFmpeg on the CPU, NVDEC on CUDA): a file's metadata, and
the frames of one clip by index, seeking to just those frames.

- :func:`video_metadata` reads the number of frames, the frame rate, the duration and the frame
  size of a file (or of its bytes, e.g. read from a shard).
- :func:`decode_clip` decodes the frames at the given indices with
  ``VideoDecoder.get_frames_at``: torchcodec seeks to the key frame before the first one and
  decodes forward only as far as the last one (repeated indices, from ``pad_short``, are decoded
  once), never from the start of the file as a naive loop over ``av.open(...).decode()`` does.

``seek_mode="exact"`` (torchcodec's default), chosen over ``approximate``: the exact mode scans
the file's packets once when the decoder opens (demuxing, no decoding: for a 10 s 480x360
30 fps H.264 file, 4.0 ms against approximate's 3.1 ms, next to 23 ms for opening it and
decoding a 16-frame clip at stride 2, one core), and in exchange frame ``i`` is frame ``i`` and
``num_frames`` is the count of frames really in the stream. The approximate mode trusts the
header, which for WebM/MKV often has no frame count and for variable-frame-rate files maps an
index to the wrong frame; the clip windows are drawn from the cached ``num_frames``, so a count
that disagrees with what the decoder returns would fail (or shift) clips mid-epoch.

torchcodec needs FFmpeg's shared libraries (4 to 7); without them an older torchcodec fails to
import and a newer one imports but fails when a decoder opens. :func:`check_decoder` tries both
once, before any file is opened, and says what to install (never blaming the files). Nothing
else imports torchcodec.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from accel_train.errors import UserError

SEEK_MODE = "exact"  # see the module docstring
INSTALL = (
    "Install FFmpeg's shared libraries (`apt-get install ffmpeg`, or `conda install -c "
    "conda-forge 'ffmpeg<8'`) and torchcodec (`pip install accel-train[video]`)"
)


@dataclass(frozen=True)
class VideoMeta:
    """What a video's stream says about itself (torchcodec's exact scan)."""

    num_frames: int
    fps: float
    duration_s: float
    height: int
    width: int


FIX = (
    "Re-encode it (e.g. `ffmpeg -i <file> -c:v libx264 -pix_fmt yuv420p <new>.mp4`) or move it "
    "out of dataset.root."
)


class VideoReadError(UserError):
    """A video file that cannot be decoded: ``what`` names it and why, ``kind`` is ``empty``,
    ``audio-only`` or ``unreadable`` (the header check groups the files by it)."""

    def __init__(self, what: str, kind: str = "unreadable"):
        if what.startswith("Caught "):  # re-created by torch from a loader worker's (UserError)
            super().__init__(what)
        else:
            super().__init__(f"dataset=video_folder: {what}. {FIX}")
        self.what, self.kind = what, kind


def decoder_class():
    """torchcodec's VideoDecoder, or a UserError saying what to install."""
    try:
        from torchcodec.decoders import VideoDecoder
    except (ImportError, RuntimeError, OSError) as err:  # OSError/RuntimeError: no FFmpeg libs
        cause = " ".join(str(err).split())[:300]
        raise UserError(
            f"dataset=video_folder decodes videos with torchcodec, which could not be loaded "
            f"({type(err).__name__}: {cause}). {INSTALL}, then run again."
        ) from None
    return VideoDecoder


def _no_ffmpeg(err: BaseException) -> bool:
    """Whether torchcodec's error is FFmpeg's libraries (or its own) failing to load."""
    text = str(err)
    return "libtorchcodec" in text or ("FFmpeg" in text and "load" in text.lower())


def _install_error(err: BaseException) -> UserError:
    cause = " ".join(str(err).split())[:200]
    return UserError(
        "Videos are decoded by torchcodec, which imports but cannot load FFmpeg's shared "
        f"libraries ({type(err).__name__}: {cause}): no video can be read "
        f"until they are installed, and the video files themselves are not at fault. "
        f"{INSTALL}, then run again."
    )


def check_decoder() -> None:
    """Once, before any file is opened: torchcodec imports *and* loads FFmpeg's libraries, or
    a UserError saying what to install (torchcodec >= 0.7 imports without FFmpeg and fails
    only when a decoder opens, which would blame every file)."""
    decoder_class()
    try:
        from torchcodec._internally_replaced_utils import load_core_libraries
    except ImportError:  # another torchcodec: open_video still tells the missing libraries
        return
    try:
        load_core_libraries()
    except Exception as err:  # noqa: BLE001 (torchcodec raises RuntimeError/OSError)
        raise _install_error(err) from None


def _device(device: str) -> str:
    """torchcodec's device name: ``gpu`` (dataset.decode's spelling) is ``cuda``."""
    return "cuda" if device == "gpu" else device


def _name(source: str | bytes) -> str:
    return source if isinstance(source, str) else f"<{len(source)} bytes of video>"


def _why(err: BaseException, name: str = "") -> str:
    """FFmpeg's reason, without torchcodec's C++ source location (nor the file's name)."""
    text = re.sub(r"^[^,]*, \S+\.cpp:\d+, ", "", " ".join(str(err).split()))
    text = text.replace(f": {name} ", ": ").replace(name, "").strip() if name else text
    return text[:200]


def open_video(source: str | bytes, *, threads: int = 1, device: str = "cpu"):
    """A torchcodec VideoDecoder of the file (or its bytes), or a :class:`VideoReadError`
    naming it and why (an empty file, one without a video stream, one FFmpeg cannot read)."""
    decoder = decoder_class()
    name = _name(source)
    if isinstance(source, str) and not os.path.isfile(source):
        raise VideoReadError(f"{name} does not exist (or is not a file)", "unreadable")
    if (isinstance(source, bytes) and not source) or (
        isinstance(source, str) and os.path.getsize(source) == 0
    ):
        raise VideoReadError(f"{name} is empty (0 bytes)", "empty")
    try:
        return decoder(
            source, num_ffmpeg_threads=int(threads), device=_device(device), seek_mode=SEEK_MODE
        )
    except (RuntimeError, ValueError, OSError) as err:
        if _no_ffmpeg(err):  # the libraries, not this file
            raise _install_error(err) from None
        kind = "audio-only" if _has_audio(source) else "unreadable"
        why = "has an audio stream and no video stream" if kind == "audio-only" else (
            f"cannot be decoded ({_why(err, name)})"
        )  # fmt: skip
        raise VideoReadError(f"{name} {why}", kind) from None


def _has_audio(source: str | bytes) -> bool:
    """Whether FFmpeg finds an audio stream (for a file without a video one)."""
    try:
        from torchcodec.decoders import AudioDecoder

        AudioDecoder(source)
    except (ImportError, RuntimeError, ValueError, OSError):
        return False
    return True


def video_metadata(source: str | bytes) -> VideoMeta:
    """The stream's :class:`VideoMeta` (a :class:`VideoReadError` when it cannot be read)."""
    meta = open_video(source).metadata
    num_frames = int(meta.num_frames or 0)
    fps = float(meta.average_fps or 0.0)
    duration = float(meta.duration_seconds or (num_frames / fps if fps else 0.0))
    return VideoMeta(num_frames, fps, duration, int(meta.height or 0), int(meta.width or 0))


def decode_clip(
    source: str | bytes, indices: Sequence[int], *, threads: int = 1, device: str = "cpu"
) -> torch.Tensor:
    """uint8 (T, C, H, W): the frames at ``indices`` (in that order; repeats allowed), decoded
    on ``device`` (``cpu``, or ``cuda``/``gpu`` for NVDEC) with ``threads`` FFmpeg threads."""
    decoder = open_video(source, threads=threads, device=device)
    try:
        return decoder.get_frames_at(indices=[int(i) for i in indices]).data
    except (RuntimeError, ValueError, IndexError) as err:
        raise VideoReadError(
            f"{_name(source)}: frames {list(indices)[:3]}..{list(indices)[-1:]} cannot be "
            f"decoded ({_why(err)})",
            "unreadable",
        ) from None
