"""The video metadata cache: what torchcodec's exact scan said about each file (frames, fps,
duration, frame size), kept between runs so a run does not scan every video again.

Where: ``dataset.metadata_cache`` is a folder, by default
``${XDG_CACHE_HOME:-~/.cache}/accel-train/video-metadata``, holding one JSON file per data set,
named by a hash of the absolute ``dataset.root`` (lists of videos under the same root share it).
That is what users of the neighbouring tools expect: Hugging Face datasets keeps its caches under
``~/.cache/huggingface/datasets`` (``XDG_CACHE_HOME`` moves it), and torchvision's video
reference caches Kinetics' clip metadata under ``~/.torch/vision/datasets/kinetics/<hash of the
path>.pt``, both in the user's cache, never beside the data: a data folder may be read-only,
shared by several users or mounted from a bucket, so nothing is ever written into it (a cache
folder inside ``dataset.root`` is refused). ``null`` (or ``false``) turns the cache off.

An entry is keyed by the file's absolute path, size and modification time (ns): a file replaced,
re-encoded or touched since is read again. Only files that gave a clip-worthy stream are stored;
the header check's refusals (empty, unreadable, audio-only, no frames) are read again every run.
JSON, not pickle: loading the cache never runs code, and a foreign or damaged file is ignored
(with a warning naming it), never overwritten.

Writes are atomic (a temporary file in the same folder, then a rename) and merged under an
advisory lock (``<file>.lock``, left in place): two runs on the same data set writing at once
both keep their entries. Only the launching process reads metadata (data/video/folder.py), so
DDP ranks never write it. Entries of files that no longer exist are dropped on the next write.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from accel_train.data.video.decode import VideoMeta
from accel_train.errors import UserError

log = logging.getLogger(__name__)

FORMAT = "accel-train video metadata"
VERSION = 1
FIELDS = ["size", "mtime_ns", "num_frames", "fps", "duration_s", "height", "width"]
OFF = {"", "null", "none", "false", "off", "no", "0"}  # dataset.metadata_cache's "no cache"

try:  # POSIX; elsewhere the rename alone keeps the file whole (a concurrent merge may lose one)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None


def cache_file(folder: str | None, root: Path) -> Path | None:
    """The data set's cache file in ``folder`` (None: the cache is off)."""
    if folder is None or str(folder).strip().lower() in OFF:
        return None
    where = Path(os.path.expanduser(str(folder))).absolute()
    data = root.resolve()
    if where.resolve() == data or data in where.resolve().parents:
        raise UserError(
            f"dataset.metadata_cache={folder!r} is inside dataset.root={str(root)!r}: the data "
            "folder is never written to. Point `dataset.metadata_cache=` at a folder outside it "
            "(the default is ~/.cache/accel-train/video-metadata), or set it to null."
        )
    digest = hashlib.sha256(str(data).encode()).hexdigest()[:16]
    return where / f"{digest}.json"


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


class MetadataCache:
    """The cache file of one data set; ``file=None``: off (lookups miss, stores do nothing)."""

    def __init__(self, file: Path | None):
        self.file = file
        self.stats: dict[str, tuple[int, int] | None] = {}

    def _load(self) -> dict[str, list] | None:
        """The stored entries; {} when there is no file, None for a file that is not ours."""
        try:
            data = json.loads(self.file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            log.warning("dataset.metadata_cache: %s cannot be read (%s): not used", self.file, err)
            return None
        if not (isinstance(data, dict) and data.get("format") == FORMAT):
            log.warning(
                "dataset.metadata_cache: %s is not an accel-train metadata cache: not used, "
                "not overwritten (move it away, or set dataset.metadata_cache elsewhere)",
                self.file,
            )
            return None
        if data.get("version") != VERSION or data.get("fields") != FIELDS:
            return {}  # another version's layout: read again, then replaced by this one's
        videos = data.get("videos")
        return videos if isinstance(videos, dict) else {}

    def lookup(self, paths: list[str]) -> dict[str, VideoMeta]:
        """path -> VideoMeta of the paths whose stored size and mtime are the file's own."""
        if self.file is None:
            return {}
        stored = self._load() or {}
        found = {}
        for path in paths:
            self.stats[path] = stat = _stat(path)
            entry = stored.get(path)
            if stat is None or not isinstance(entry, list) or len(entry) != len(FIELDS):
                continue
            if (entry[0], entry[1]) == stat:
                with contextlib.suppress(TypeError, ValueError):
                    found[path] = VideoMeta(int(entry[2]), float(entry[3]), float(entry[4]),
                                            int(entry[5]), int(entry[6]))  # fmt: skip
        return found

    def store(self, metas: dict[str, VideoMeta]) -> None:
        """Merge the newly read ``metas`` into the file (atomically, under the lock)."""
        new = {
            p: [*self.stats[p], m.num_frames, m.fps, m.duration_s, m.height, m.width]
            for p, m in metas.items()
            if self.stats.get(p) is not None
        }
        if self.file is None or not new:
            return
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                stored = self._load()
                if stored is None:
                    return
                kept = {p: e for p, e in stored.items() if p in self.stats or os.path.exists(p)}
                self._write({**kept, **new})
        except OSError as err:
            log.warning(
                "dataset.metadata_cache: cannot write %s (%s): the next run reads the metadata "
                "again. Set `dataset.metadata_cache=<a writable folder>` (or null).",
                self.file,
                err.strerror or err,
            )

    @contextlib.contextmanager
    def _locked(self):
        if fcntl is None:  # pragma: no cover
            yield
            return
        with open(f"{self.file}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write(self, videos: dict[str, list]) -> None:
        data = {"format": FORMAT, "version": VERSION, "fields": FIELDS, "videos": videos}
        where, name = self.file.parent, self.file.name
        fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, separators=(",", ":"))
            os.replace(tmp, self.file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # our own temporary file, never the cache
            raise
