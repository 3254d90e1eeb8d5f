"""The disk cache of the deterministic part (`dataset.cache=disk`): like MONAI's
PersistentDataset, but

- keyed by each file's content stamp (absolute path, size, modification time in ns) **and** the
  deterministic settings (orientation, spacing, window, crop, the transforms' version):
  MONAI's default key is the path alone, so a replaced file or a new spacing would read a stale
  entry;
- stored as plain arrays (`image.npy`, `label.npy`, read memory-mapped with
  allow_pickle=False) and a `meta.json` (the affine after the transforms, the source's affine
  and shape: what inverting the transforms needs): loading executes nothing, never a pickle;
- written atomically: each entry is made in a temporary folder beside it, then renamed into
  place; a run killed while writing leaves a `.tmp-*` folder that no run reads (and that the next
  write of the same entry ignores);
- outside the data folder (`dataset.cache_dir`, by default
  `${XDG_CACHE_HOME:-~/.cache}/accel-train/volumes`, as the video metadata cache): a data folder
  may be read-only or shared; a cache_dir inside dataset.root is refused.

Two runs writing the same entry at once both finish: the second rename finds the entry made and
drops its own copy. Entries are never removed by a run (the folder is the user's to clear)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from accel_train.errors import UserError

FORMAT = "accel-train volume cache"
VERSION = 1


def stamp(path: Path) -> list:
    st = os.stat(path)
    return [str(path), st.st_size, st.st_mtime_ns]


def key_of(files: list[Path], settings: dict) -> str:
    """The entry's name: a hash of the files' stamps and the settings that made it."""
    text = json.dumps({"format": FORMAT, "version": VERSION, "files": [stamp(f) for f in files],
                       "settings": settings}, sort_keys=True)  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cache_folder(cache_dir: str | None, root: Path) -> Path:
    if not cache_dir:
        raise UserError(
            "dataset.cache=disk needs dataset.cache_dir: a folder outside dataset.root for the "
            "preprocessed volumes (the default is ~/.cache/accel-train/volumes)."
        )
    where = Path(os.path.expanduser(str(cache_dir))).absolute()
    data = root.resolve()
    if where.resolve() == data or data in where.resolve().parents:
        raise UserError(
            f"dataset.cache_dir={cache_dir!r} is inside dataset.root={str(root)!r}: the data "
            "folder is never written to. Point `dataset.cache_dir=` at a folder outside it (the "
            "default is ~/.cache/accel-train/volumes)."
        )
    return where


class DiskCache:
    def __init__(self, folder: Path):
        self.folder = folder
        self.hits = self.writes = 0

    def load(self, key: str) -> dict | None:
        """{"image", "label": memory-mapped arrays, "meta": dict}, or None (absent, or not
        ours: read again)."""
        entry = self.folder / key
        try:
            meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
            if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                return None
            image = np.load(entry / "image.npy", mmap_mode="r", allow_pickle=False)
            label = np.load(entry / "label.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError):
            return None
        self.hits += 1
        return {"image": image, "label": label, "meta": meta}

    def store(self, key: str, image: np.ndarray, label: np.ndarray, meta: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.folder, prefix=f".{key}.tmp-"))
        try:
            np.save(tmp / "image.npy", np.ascontiguousarray(image), allow_pickle=False)
            np.save(tmp / "label.npy", np.ascontiguousarray(label), allow_pickle=False)
            body = {"format": FORMAT, "version": VERSION, **meta}
            (tmp / "meta.json").write_text(json.dumps(body), encoding="utf-8")
            try:
                os.rename(tmp, self.folder / key)  # atomic: the entry appears whole or not at all
            except OSError:
                if not (self.folder / key / "meta.json").is_file():
                    raise
                shutil.rmtree(tmp)  # another run made it first: ours is the same, dropped
        except BaseException:
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)  # our own temporary folder, never an entry
            raise
        self.writes += 1

    def load_json(self, name: str) -> dict | None:
        try:
            data = json.loads((self.folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("format") == FORMAT else None

    def store_json(self, name: str, data: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"format": FORMAT, **data}, f)
            os.replace(tmp, self.folder / name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
