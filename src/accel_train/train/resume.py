"""Resume: continue a run from a checkpoint (`resume=auto` or a path), exactly.

The checkpoint holds the model, optimizer, GradScaler, schedule, progress (epoch, step, batch in
epoch, best validation accuracy), every technique's state and every RNG state, so the resumed run
draws the same batches and augmentations as an uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from accel_train import checkpoint as ckpt_io
from accel_train.errors import UserError

if TYPE_CHECKING:  # the loop calls this module; only the type is needed here
    from accel_train.train.loop import Loop


def resume(loop: Loop) -> str | None:
    """Load the checkpoint `resume` names into the loop; returns its path (None: fresh start)."""
    wanted = loop.cfg.resume
    if wanted is None:
        return None
    path = loop.ckpt_dir / f"last{loop.ckpt_suffix}" if wanted == "auto" else Path(wanted)
    if wanted == "auto" and not path.exists():
        return None  # nothing to resume from: a fresh start, not an error
    if path.is_dir():  # a sharded checkpoint, loadable at any world size
        state = ckpt_io.load_sharded_meta(path, key="resume")
        ckpt_io.load_sharded(loop.module, loop.optimizer, path)
    else:
        state = ckpt_io.load_checkpoint(path, key="resume")
        if loop.sharded:
            raise UserError(
                f"resume={path}: a single-file checkpoint cannot be loaded into strategy=fsdp; "
                "resume it with strategy=ddp or single."
            )
        loop.module.load_state_dict(state["model"])
        loop.optimizer.load_state_dict(state["optimizer"])
    loop.scaler.load_state_dict(state["scaler"])
    if loop.scheduler is not None and state["scheduler"] is not None:
        loop.scheduler.load_state_dict(state["scheduler"])
    p = state["progress"]
    loop.epoch, loop.step, loop.batch_in_epoch = p["epoch"], p["step"], p["batch_in_epoch"]
    loop.best_val_acc = p["best_val_acc"]
    loop.last_val = tuple(p["last_val"]) if p["last_val"] else None
    saved = state.get("techniques", {})
    for technique in loop.techniques:
        if technique.name in saved:
            technique.load_state_dict(saved[technique.name])
    ckpt_io.set_rng_state(state["rng"])
    loop.metrics.log({"event": "resume", "from": str(path)}, loop.step, loop.epoch)
    return str(path)
