"""What a checkpoint save killed half-way leaves behind, cleared when the run dir's lock is
taken (launchers/lock.py). Apart from checkpoint.py (which re-exports these) because the lock is
taken at every start-up, before the config is checked: this module imports no torch."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

# What a save killed half-way leaves in checkpoints/: `.<name>.tmp-<pid>` (atomic_save),
# `.<name>.dcp.tmp/` and `.<name>.dcp.old/` (save_sharded).
_TEMP_FILE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")
_DCP_TEMP = re.compile(r"^\.(?P<name>.+\.dcp)\.(?P<kind>tmp|old)$")


def remove_stale_temps(ckpt_dir: Path, *, locked: bool) -> list[Path]:
    """Clear what killed saves left in `ckpt_dir`; returns what was removed (or restored).

    `locked`: this process holds the run dir's lock (launchers/lock.py), so no other process saves
    here and every temp is stale. Without it only a `.tmp-<pid>` file whose process is gone
    goes (a pid is only meaningful on this host; a sharded temp names no process and stays).
    A sharded save killed between its two renames leaves no `<name>.dcp` but a complete
    `.<name>.dcp.tmp` (or the previous `.<name>.dcp.old`): that one is renamed back into place
    instead of removed. Errors (e.g. a read-only directory) leave things as they are: the next
    save reports them."""
    if not ckpt_dir.is_dir():
        return []
    touched: list[Path] = []
    entries = sorted(ckpt_dir.iterdir())
    for entry in entries:
        m = _TEMP_FILE.match(entry.name)
        if m and (locked or not pid_alive(int(m["pid"]))):
            with contextlib.suppress(OSError):
                entry.unlink()
                touched.append(entry)
    if not locked:
        return touched
    for entry in entries:
        m = _DCP_TEMP.match(entry.name)
        if not m or not entry.exists():
            continue
        final = ckpt_dir / m["name"]
        tmp, old = ckpt_dir / f".{m['name']}.tmp", ckpt_dir / f".{m['name']}.old"
        with contextlib.suppress(OSError):
            if not final.exists():
                # Killed between `last.dcp -> .old` and `.tmp -> last.dcp`: the new one is
                # whole once its meta.pt (written last) is there; else take the old one back.
                complete = (tmp / "meta.pt").is_file() and (tmp / ".metadata").is_file()
                source = tmp if complete else old
                if source.is_dir():
                    os.replace(source, final)
                    touched.append(final)
            for leftover in (tmp, old):
                if leftover.exists():
                    shutil.rmtree(leftover)
                    touched.append(leftover)
    return touched


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
