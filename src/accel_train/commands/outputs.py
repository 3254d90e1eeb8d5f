"""How `accel-data tokenize` and `accel-data shard` write their output folder, so that nothing
the user already has is lost and nothing half-written is left behind.

A command writes into `.<out>.partial-<pid>` beside `out` and moves the result into place at
the end. An interrupt or a failure removes that folder at once (the commands' `except`); a
process killed outright (SIGKILL, the machine) cannot, so every run first removes the
leftovers of processes that are no longer alive (`remove_leftovers`). What `overwrite=true`
may replace, and how the finished folder moves into place, is written.py's: only the files the
command listed there, never a file it did not write.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from accel_train.errors import UserError

_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?:partial|old)-(?P<pid>\d+)$")
STAGING_PREFIX = "accel-shard-"  # LitData's staging folders in $TMPDIR: accel-shard-<pid>-*
_STAGING = re.compile(rf"^{STAGING_PREFIX}(?P<pid>\d+)-")


def resolved(out: Path) -> Path:
    """`out` as an absolute path with a name (`out=.` is the current folder by its name)."""
    return out.expanduser().resolve()


def partial_path(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial-{os.getpid()}")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_leftovers(out: Path) -> list[Path]:
    """Remove what killed runs writing `out` left: their partial and old folders beside `out`
    and LitData's staging folders in $TMPDIR. Returns what was removed."""
    removed = []
    candidates: list[tuple[Path, int]] = []
    if out.parent.is_dir():
        for path in out.parent.iterdir():
            match = _LEFTOVER.match(path.name)
            if match and match["name"] == out.name:
                candidates.append((path, int(match["pid"])))
    for path in Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*"):
        match = _STAGING.match(path.name)
        if match:
            candidates.append((path, int(match["pid"])))
    for path, pid in candidates:
        if not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def refuse_inside(out: Path, source: Path, key: str, source_key: str) -> None:
    """`out` may be neither the source, nor a folder that holds it (replacing it would remove
    the very data being read), nor a folder inside it (its files would join the data: a shard
    folder under an image folder's train/ became a class of its own)."""
    out_at, source_at = resolved(out), resolved(source)
    if out_at == source_at or out_at in source_at.parents or source_at in out_at.parents:
        where = "is inside" if source_at in out_at.parents else "is or holds"
        raise UserError(
            f"{key}={out} {where} {source_key}={source}, the data this command reads: writing "
            f"there would change that data. Choose a folder outside it (e.g. `{key}="
            f"{source_at.parent / (source_at.name + '-shards')}` beside it)."
        )


class Interrupted(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt so that the same clean-up runs."""

    code = 143


@contextlib.contextmanager
def interrupts_exit(prog: str) -> Iterator[None]:
    """Ctrl-C or SIGTERM: the commands' own clean-up runs (their `except`), then one line on
    stderr and exit 130 (143 for SIGTERM), never a traceback or exit 0."""

    def on_term(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except KeyboardInterrupt as err:
        code = getattr(err, "code", 130)
        print(f"{prog}: interrupted (its partial output was removed)", file=sys.stderr)
        sys.exit(code)
    finally:
        signal.signal(signal.SIGTERM, previous)
