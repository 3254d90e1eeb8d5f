"""Finding the checkpoint a run resumes from and reading it (all but sharded weights): the one
place resume state is read, below both the launch side (launchers/launch.py: check_resume, before
the run dir is written) and the loop (train/resume.py; train/auto_batch.py takes a resumed run's
batch size from it), which call it downward; neither imports the other.

A checkpoint is read once per process: the first read is kept (keyed by the file's path, size
and mtime, so a checkpoint replaced in between is read again) until `forget()`, which the loop's
resume calls once it has loaded the state, and the launcher before it hands the run to other
processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accel_train.checkpoint_formats import CHECKPOINT_FORMATS, format_of
from accel_train.config.moved import renamed


def find_checkpoint(wanted: str | None, ckpt_dir: Path, suffix: str) -> Path | None:
    """The checkpoint `resume` names (None: start fresh). `auto` is this run's last checkpoint
    if there is one, in either format (`suffix`, .pt or .dcp, is what this run writes; FSDP
    writes the other one at another world size): the newer of the two, rather than a silent
    fresh start next to a checkpoint of the other kind."""
    if wanted is None:
        return None
    if wanted != "auto":
        return Path(wanted)

    def written(p: Path) -> Path:  # e.g. a .dcp directory is complete once its meta.pt is
        return format_of(p).complete(p)

    others = [f.suffix for f in CHECKPOINT_FORMATS.values() if f.suffix != suffix]
    found = [
        ckpt_dir / f"last{s}" for s in (suffix, *others) if written(ckpt_dir / f"last{s}").is_file()
    ]
    if not found:
        return None
    return max(found, key=lambda p: written(p).stat().st_mtime_ns)  # a tie: this run's format


_read: dict[tuple, dict[str, Any]] = {}  # at most one entry: the run's checkpoint


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Everything but the sharded weights (those load into the module later)."""
    fmt = format_of(path)
    file = fmt.complete(path)
    try:
        st = file.stat()
        key = (str(file.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        key = None  # missing: the load below says so in one paragraph
    if key is not None and key in _read:
        return _read[key]
    state = fmt.read(path, key="resume")
    if isinstance(state.get("config"), dict):  # paths that moved since: named as they are now
        state["config"] = renamed(state["config"])
    if key is not None:
        _read.clear()
        _read[key] = state
    return state


def forget() -> None:
    """Drop the kept checkpoint (its weights are in the model now, or in another process's)."""
    _read.clear()
