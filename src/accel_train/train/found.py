"""Finding the checkpoint a run resumes from and reading it (all but sharded weights): shared by
train/resume.py and train/auto_batch.py (which takes a resumed run's batch size from it), so
neither imports the other and the loop's modules form no cycle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accel_train import checkpoint as ckpt_io


def find_checkpoint(wanted: str | None, ckpt_dir: Path, suffix: str) -> Path | None:
    """The checkpoint `resume` names (None: start fresh). `auto` is this run's last checkpoint
    if there is one, in either format (`suffix`, .pt or .dcp, is what this run writes; FSDP
    writes the other one at another world size): the newer of the two, rather than a silent
    fresh start next to a checkpoint of the other kind."""
    if wanted is None:
        return None
    if wanted != "auto":
        return Path(wanted)

    def written(p: Path) -> Path:  # a .dcp directory is complete once its meta.pt is there
        return p / "meta.pt" if p.suffix == ".dcp" else p

    other = ".dcp" if suffix == ".pt" else ".pt"
    found = [
        ckpt_dir / f"last{s}" for s in (suffix, other) if written(ckpt_dir / f"last{s}").is_file()
    ]
    if not found:
        return None
    return max(found, key=lambda p: written(p).stat().st_mtime_ns)  # a tie: this run's format


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Everything but the sharded weights (those load into the module later)."""
    if path.is_dir():
        return ckpt_io.load_sharded_meta(path, key="resume")
    return ckpt_io.load_checkpoint(path, key="resume")
