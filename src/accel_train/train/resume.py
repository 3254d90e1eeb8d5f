"""Resume: continue a run from a checkpoint (`resume=auto` or a path), exactly, and never with a
silently different experiment.

The checkpoint holds the model, optimizer, GradScaler, schedule, progress (epoch, step, batch in
epoch, best validation accuracy, the run's length in optimizer steps), the metrics rows written
so far, every technique's state, every RNG state and the resolved config of the run that wrote
it. With
the same config the resumed run draws the same batches and augmentations as an uninterrupted one
and ends with the same weights.

What may differ from the checkpoint's config: train/resume_rules.py (RULES).

The learning-rate schedule:

- Same length (total optimizer steps), same scheduler.*, same lr: the schedule's state is
  restored exactly (bit-identical to an uninterrupted run).
- Otherwise it is rebuilt from the new config for the new length and fast-forwarded to the
  checkpoint's step: from there on the lr is that of a run planned with the new config from the
  start. A cosine or OneCycle run extended from 1 to 2 epochs anneals over the 2 epochs from
  where it is (its lr moves to the 2-epoch curve at the resumed step; OneCycle's fixed
  total_steps no longer crashes the resume). With scheduler=none a new optimizer.lr is the lr
  from the resumed step on. Under OneCycle, beta1/momentum follow the schedule (cycle_momentum).

The run dir:

- `check_resume(cfg)` runs in the launcher (once it holds the run dir's lock) before anything is
  written: a checkpoint that does not load or a refused change leaves the run dir as it was
  (config.yaml, checkpoints, metrics.jsonl/csv, summary.json: same bytes, same mtimes). The
  loop checks again (a user's own torchrun has no launcher).
- A run that already finished (its checkpoint at the run's length, summary.json written) is not
  trained again: "already finished", summary.json stands, exit 0. One killed after its last
  checkpoint but before summary.json (in the test pass) trains nothing and runs the test pass.
- Metrics rows logged after the checkpoint (a kill between checkpoints) are dropped before the
  resumed run logs those steps again (MetricsLogger.rewind), then a {"event": "resume"} row.
- Resuming from another run's checkpoint (`resume=<path>` into a new run dir) hard-links (or
  copies) that run's best checkpoint into this run's checkpoints/ and keeps its best validation
  scores, so best.pt, the test pass and `accel-eval .../best.pt` mean what they mean in an
  uninterrupted run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig

from accel_train import checkpoint as ckpt_io
from accel_train.checkpoint_formats import format_of
from accel_train.config.run_config import to_container
from accel_train.errors import UserError
from accel_train.optim import base_learning_rates, build_scheduler
from accel_train.strategies import strategy_for
from accel_train.train.checkpointing import best_score, link_or_copy
from accel_train.train.found import find_checkpoint, forget, read_checkpoint
from accel_train.train.resume_rules import (
    HYPERPARAMETERS,
    LR_KEYS,
    check_loader_order,
    check_world_size,
    config_changes,
    fmt_value,
    length_changed,
    plain,
)

log = logging.getLogger("accel_train")

# ---- finding and reading the checkpoint --------------------------------------------------


def _is_own(path: Path, ckpt_dir: Path) -> bool:
    return path.resolve().parent == ckpt_dir.resolve()


def _finished_summary(run_dir: Path) -> dict[str, Any] | None:
    """summary.json of a run that ran to its end (None: none, unreadable, or preempted)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("status") == "preempted":
        return None
    return summary


def _say_finished(run_dir: Path, summary: dict[str, Any]) -> None:
    log.info(
        "%s already finished (%s steps, %s epochs, best %s %s): summary.json is kept and "
        "nothing is trained. To train longer, raise trainer.max_epochs or trainer.max_steps.",
        run_dir,
        summary.get("steps"),
        summary.get("epochs"),
        summary.get("monitor"),
        summary.get("best_score"),
    )


# ---- before anything is written (the launcher) -------------------------------------------


def check_resume(cfg: DictConfig, world_size: int | None = None) -> dict[str, Any] | None:
    """(`world_size`: the processes the run will have, None when not known yet.) What can be
    decided about `resume` before the run dir is written to. The launcher calls
    this first, so that a checkpoint that does not load, or a refused config change, stops the
    run with the run dir exactly as it was. Returns the summary of a run that already finished
    (the launcher then trains nothing and exits 0), else None. Reads the checkpoint once more
    than the loop does; the page cache makes that cheap next to training."""
    if cfg.resume is None:
        return None
    run_dir = Path(cfg.paths.output_dir)
    ckpt_dir = run_dir / "checkpoints"
    suffix = strategy_for(cfg).checkpoint_suffix(distributed=True)  # (the other format too)
    path = find_checkpoint(cfg.resume, ckpt_dir, suffix)
    if path is None:
        return None
    state = read_checkpoint(path)
    changes = config_changes(state["config"], to_container(cfg), cfg.resume, path)
    progress = state["progress"]
    if world_size is not None:
        strategy = strategy_for(cfg)
        ranks, width = strategy.data_world(world_size), strategy.describe_width(world_size)
        check_world_size(progress, ranks, width, cfg.resume, path)
    total = progress.get("total_steps")  # None in checkpoints before it: the loop decides
    length_changed = any(c.key in ("trainer.max_epochs", "trainer.max_steps") for c in changes)
    if _is_own(path, ckpt_dir) and total is not None and not length_changed:
        done = progress["step"] >= total or progress.get("finished_early")
        summary = _finished_summary(run_dir) if done else None
        if summary is not None:
            _say_finished(run_dir, summary)
            return summary
    return None


# ---- into the loop -----------------------------------------------------------------------


class Loop(Protocol):
    """What resume reads: the loop passes itself (train/loop.py calls this module downward;
    this module never imports the loop). checkpoint_state() writes what resume() reads back.
    Resume loads the components' own state (weights, optimizer, scaler, techniques, checkpoint
    ranking, RNG) and returns the loop's progress as a `Resumed`, which the loop applies in one
    place (Loop._apply)."""

    cfg: DictConfig
    env: Any
    parts: Any
    module: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    task: Any
    techniques: list
    train_loader: Any
    metrics: Any
    checkpoints: Any
    run_dir: Path
    ckpt_dir: Path
    checkpointer: Any  # its format: `suffix`, `sharded`
    strategy: Any  # describe_width
    data_world: int
    # What checkpoint_state() records of the loop's progress:
    epoch: int
    step: int
    batch_in_epoch: int
    best_val: dict[str, float]
    last_val: dict[str, float] | None
    validated_step: int | None
    finish_reason: str | None


@dataclass
class Resumed:
    """Where the checkpoint left the run: the loop applies it (Loop._apply)."""

    path: str
    summary: dict[str, Any] | None = None  # the run had already finished: its summary.json
    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    best_val: dict[str, float] = field(default_factory=dict)
    last_val: dict[str, float] | None = None
    validated_step: int | None = None  # the step of its last validation (None: not recorded)
    finish_reason: str | None = None  # finished early: only the test pass is left
    scheduler: Any = None  # a schedule rebuilt for a new length or config (None: restored)
    # The run's length from the checkpoint's progress on (resumed_length): optimizer steps in
    # all, and the epoch the loop stops before.
    total_steps: int = 0
    max_epochs: int = 0


def checkpoint_state(loop: Loop) -> dict[str, Any]:
    """Everything a checkpoint holds but the model and optimizer (train/checkpointer.py writes
    it, resume() reads it back)."""
    return {
        "scaler": loop.scaler.state_dict(),
        "scheduler": loop.scheduler.state_dict() if loop.scheduler else None,
        "progress": {
            "epoch": loop.epoch,
            "step": loop.step,
            "batch_in_epoch": loop.batch_in_epoch,
            "best_val": dict(loop.best_val),
            "checkpointing": loop.checkpoints.state_dict(),  # checkpoint.monitor's best, top k
            "last_val": dict(loop.last_val) if loop.last_val else None,
            # A resume redoes a validation due at its step that it does not record.
            "validated_step": loop.validated_step,
            # The run's length: a resume to another length rebuilds the lr schedule.
            "total_steps": loop.parts.total_steps,
            # batch_in_epoch counts batches of this many processes' shards (resume checks);
            # under pipeline the replicas, not the stages, share the data.
            "world_size": loop.data_world,
            # ... and how this run's processes make them (a resume's refusal says it).
            "width": loop.strategy.describe_width(loop.env.world_size),
            # Settings beyond the seed that a loader's order depends on (resume checks).
            "order_depends_on": dict(getattr(loop.train_loader, "order_depends_on", {})),
            # Finished before its length (early stopping, a target): nothing left to train.
            "finished_early": loop.finish_reason,
        },
        # The metrics rows written so far: a resume drops those after it (not duplicated).
        "metrics_rows": loop.metrics.position(),
        "techniques": {t.name: t.state_dict() for t in loop.techniques},
        "task": loop.task.checkpoint_data(),  # e.g. a language model's tokenizer
        # What a task carries from step to step (GRPO's completions kept for num_iterations).
        "task_state": loop.task.state_dict(),
        "rng": ckpt_io.rng_state(),
        "config": to_container(loop.cfg),
    }


def resume(loop: Loop) -> Resumed | None:
    """Load the checkpoint `resume` names into the loop (None: a fresh start). With a summary:
    the run had already finished, nothing was loaded, and there is nothing to train."""
    wanted = loop.cfg.resume
    path = find_checkpoint(wanted, loop.ckpt_dir, loop.checkpointer.suffix)
    if path is None:
        return None  # nothing to resume from: a fresh start, not an error
    state = read_checkpoint(path)
    changes = config_changes(state["config"], to_container(loop.cfg), wanted, path)
    _check_task_data(loop, state, wanted, path)
    changed = {c.key for c in changes}
    p = state["progress"]
    width = loop.strategy.describe_width(loop.env.world_size)
    check_world_size(p, loop.data_world, width, wanted, path)
    check_loader_order(p, loop.train_loader, wanted, path)
    own = _is_own(path, loop.ckpt_dir)
    total, epochs = resumed_length(loop.cfg.trainer, p, loop.parts.steps_per_epoch)
    finished = p["step"] >= total or p["epoch"] >= epochs
    if p.get("finished_early") and not length_changed(changed):
        finished = True  # early stopping or a target ended it: nothing left to train
    if finished and own:
        summary = _finished_summary(loop.run_dir)
        if summary is not None:
            if loop.env.is_main:
                _say_finished(loop.run_dir, summary)
            return Resumed(str(path), summary)

    _load_weights_and_optimizer(loop, path, state, changed)
    forget()  # the weights are in the model now: the kept copy goes
    if state["scaler"] or not loop.scaler.is_enabled():
        loop.scaler.load_state_dict(state["scaler"])
    elif loop.env.is_main:  # e.g. amp trained on the CPU (no scaler), resumed on CUDA
        log.info("the checkpoint has no GradScaler state: loss scaling starts from its default")
    ckpt_every = state["config"].get("trainer", {}).get("ckpt_every_n_steps") or 0
    resumed = _progress(str(path), p, finished, ckpt_every)
    resumed.total_steps, resumed.max_epochs = total, epochs
    if not finished:  # (finished here: only the test pass is left, no step to schedule)
        _say_new_width(loop, p, total, epochs)
        resumed.scheduler = _restore_schedule(loop, state, changed, total)
    loop.checkpoints.load_state_dict(p, own)
    loop.task.load_state_dict(state.get("task_state") or {})
    saved = state.get("techniques", {})
    for technique in loop.techniques:
        if technique.name in saved:
            technique.load_state_dict(saved[technique.name])
    ckpt_io.set_rng_state(state["rng"])
    if not own:
        _carry_best(loop, path, state, wanted)

    logged = [c for c in changes if c.key != "resume"]
    if loop.env.is_main:
        for c in logged:
            log.info("changed on resume: %s %s -> %s", c.key, fmt_value(c.old), fmt_value(c.new))
    # The rows of this run dir logged after the checkpoint are logged again from here on.
    loop.metrics.rewind(resumed.step, state.get("metrics_rows") if own else None)
    event: dict[str, Any] = {"event": "resume", "from": str(path)}
    if logged:
        event["changed"] = {c.key: [plain(c.old), plain(c.new)] for c in logged}
    loop.metrics.log(event, resumed.step, resumed.epoch)
    return resumed


def _validated_step(p: dict[str, Any], ckpt_every: int) -> int | None:
    """The step of the checkpoint's last validation. Checkpoints written before it was recorded
    saved a trainer.ckpt_every_n_steps step before that step's validation (None: not
    recorded), any other after it."""
    if "validated_step" in p:
        return p["validated_step"]
    return None if ckpt_every and p["step"] % ckpt_every == 0 else p["step"]


def _progress(path: str, p: dict[str, Any], finished: bool, ckpt_every: int = 0) -> Resumed:
    """The loop's counters and scores as the checkpoint's `progress` recorded them."""
    best_val = dict(p.get("best_val") or {})
    if "best_val" not in p and p.get("best_val_acc", -1.0) >= 0:  # written before best_val
        best_val["acc"] = p["best_val_acc"]
    last = p["last_val"]
    if isinstance(last, list | tuple):  # written before tasks: (val/loss, val/acc)
        last = {"loss": last[0], "acc": last[1]}
    return Resumed(
        path,
        epoch=p["epoch"],
        step=p["step"],
        batch_in_epoch=p["batch_in_epoch"],
        best_val=best_val,
        last_val=dict(last) if last else None,
        validated_step=_validated_step(p, ckpt_every),
        finish_reason=p["finished_early"] if finished and p.get("finished_early") else None,
    )


def _check_task_data(loop: Loop, state: dict, wanted: str, path: Path) -> None:
    """The data must still mean what it meant to the checkpoint: a token folder re-tokenized
    with another mapping of the same size has the same config and shapes, and would train on
    remapped ids without a word."""
    conflict = loop.task.resume_conflict(state.get("task") or {})
    if conflict is None or loop.cfg.get("resume_new_tokenizer"):
        return
    key = "dataset.path" if loop.cfg.dataset.get("path") else "dataset.remote"
    where = f"{key}={loop.cfg.dataset.get(key.split('.')[1])}"
    raise UserError(
        f"resume={wanted}: the checkpoint {path} {conflict} ({where}): the same ids would "
        f"stand for other text. To continue that run, point `{key}` back at the data it was "
        "trained on, or tokenize the text again with the checkpoint's tokenizer; to train on "
        "this data anyway (the model relearns the ids, and this data's tokenizer replaces the "
        "checkpoint's), add `resume_new_tokenizer=true`."
    )


def _load_weights_and_optimizer(loop: Loop, path: Path, state: dict, changed: set[str]) -> None:
    # The new config's hyperparameters, as build_optimizer set them, before the restored state
    # overwrites them.
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in loop.optimizer.param_groups]
    keys = [HYPERPARAMETERS[k] for k in changed if k in HYPERPARAMETERS]
    onecycle = loop.cfg.scheduler.name == "onecycle"
    if "scheduler.name" in changed and state["config"]["scheduler"]["name"] == "onecycle":
        keys += ["betas", "momentum"]  # OneCycle cycled them; the new schedule does not
    fmt = format_of(path)
    try:
        if fmt.state_holds_weights:
            # Into the saved groups before loading: the optimizer places its state by them
            # (e.g. `fused` puts the step counters on the device).
            _apply(state["optimizer"]["param_groups"], fresh, keys, onecycle)
        # (A sharded checkpoint loads at any world size; a single file into a sharded run is
        # cut into its shards.)
        fmt.load_training(loop.module, loop.optimizer, path, state, loop.checkpointer.sharded)
        if not fmt.state_holds_weights:
            _apply(loop.optimizer.param_groups, fresh, keys, onecycle)
    except UserError:
        raise
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"resume={loop.cfg.resume}: {path} does not fit the model or optimizer this run "
            f"builds, although the config agrees ({first}). The code behind a _target_ changed "
            "since the checkpoint was written: restore it to continue that run, or start a "
            "fresh run in a new run dir (no `resume`)."
        ) from None


def _apply(groups: list[dict], fresh: list[dict], keys: list[str], onecycle: bool) -> None:
    for group, new in zip(groups, fresh, strict=False):
        for key in keys:
            if key not in new:
                continue
            if onecycle and key == "momentum":
                continue  # OneCycle sets it every step (cycle_momentum)
            if onecycle and key == "betas":  # beta1 is OneCycle's; beta2 is the config's
                group[key] = (group[key][0], *new[key][1:])
                continue
            group[key] = new[key]


def _restore_schedule(loop: Loop, state: dict, changed: set[str], total: int) -> Any:
    """Restore the schedule exactly (returns None), or rebuild it for a new length (`total`
    optimizer steps) or config (module doc; returns the new schedule)."""
    p, parts = state["progress"], loop.parts
    old_total = p.get("total_steps") or _total_steps(state["config"]["trainer"], parts)
    rebuild = (
        old_total != total
        or any(k in LR_KEYS for k in changed)
        or any(k.startswith("scheduler.") for k in changed)
    )
    if not rebuild:
        if loop.scheduler is not None and state["scheduler"] is not None:
            loop.scheduler.load_state_dict(state["scheduler"])
        return None
    # build_optimizer's lr (linear scaling included): the anchor of the new schedule. Without
    # `initial_lr` torch anchors the new schedule there, not at the old schedule's anchor.
    base_lrs = base_learning_rates(loop.optimizer)
    for group, base_lr in zip(loop.optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base_lr
        group.pop("initial_lr", None)
    # (the linear scaling rule's factor: a layer-decay group's own share divided out)
    lr_scale = (
        base_lrs[0] / loop.cfg.optimizer.lr / loop.optimizer.param_groups[0].get("lr_scale", 1.0)
    )
    scheduler = build_scheduler(
        loop.optimizer,
        loop.cfg.scheduler,
        total,
        lr_scale,
        start_step=p["step"],
        steps_per_epoch=parts.steps_per_epoch,
    )
    if loop.env.is_main:
        log.info(
            "lr schedule for %d steps (the checkpoint's run: %d), fast-forwarded to step %d: "
            "lr %.4g",
            total,
            old_total,
            p["step"],
            loop.optimizer.param_groups[0]["lr"],
        )
    return scheduler


def resumed_length(trainer: DictConfig, p: dict[str, Any], steps_per_epoch: int) -> tuple[int, int]:
    """(optimizer steps of the whole run, the epoch the loop stops before), resumed at the
    checkpoint's progress `p`. The steps done are kept as they are, and the epochs still to run
    count at this run's steps per epoch: at an epoch boundary the data-parallel width may have
    changed (resume_rules.check_world_size), and with it the global batch and the steps an
    epoch takes, so `max_epochs x steps_per_epoch` would count the steps already done at the old
    width against the new budget. trainer.max_steps counts optimizer steps of the whole run,
    whatever global batch each was taken at (Lightning's global_step, torchtitan's
    training.steps). For a fresh run, or one resumed at the width it was trained at, this is
    build.run_length."""
    into_epoch = -(-p["batch_in_epoch"] // trainer.accumulate_grad_batches)  # steps, ceil
    epoch_start = p["step"] - into_epoch
    total = epoch_start + max(trainer.max_epochs - p["epoch"], 0) * steps_per_epoch
    if trainer.max_steps > 0:
        total = min(total, trainer.max_steps) if trainer.max_epochs > 0 else trainer.max_steps
    epochs = p["epoch"] + max(0, -(-(total - epoch_start) // steps_per_epoch))
    return total, epochs


def _say_new_width(loop: Loop, p: dict[str, Any], total: int, epochs: int) -> None:
    """One line when the data-parallel width changed at this epoch boundary: what the steps
    still to run are made of."""
    saved = p.get("world_size")
    if not loop.env.is_main or saved in (None, loop.data_world):
        return
    t, spe = loop.cfg.trainer, loop.parts.steps_per_epoch
    left = total - p["step"]
    if t.max_steps > 0 and total == t.max_steps:
        why = (
            f"trainer.max_steps={t.max_steps} counts optimizer steps of the whole run, whatever "
            f"their global batch: {left} more"
        )
    else:
        why = f"the {epochs - p['epoch']} epoch(s) still to run are {left} more steps"
    old_batch = loop.parts.global_batch // loop.data_world * saved  # batch_size is the same
    log.info(
        "resumed with %d data-parallel rank(s) (global batch %d) from a checkpoint written with "
        "%d (global batch %d): its %d optimizer steps stand, and %s at %d an epoch, %d steps in "
        "all",
        loop.data_world,
        loop.parts.global_batch,
        saved,
        old_batch,
        p["step"],
        why,
        spe,
        total,
    )


def _total_steps(trainer: dict[str, Any], parts: Any) -> int:
    """The length of the checkpoint's run, for checkpoints that do not record it (as
    build_components computes it; the batches per epoch cannot have changed: RULES)."""
    total = trainer["max_epochs"] * parts.steps_per_epoch
    if trainer["max_steps"] > 0:
        return (
            min(total, trainer["max_steps"]) if trainer["max_epochs"] > 0 else trainer["max_steps"]
        )
    return total


# ---- the best checkpoint of the run resumed from ------------------------------------------


def _carry_best(loop: Loop, path: Path, state: dict, wanted: str) -> None:
    """Resumed from another run dir: bring that run's best checkpoint along (hard link, or copy
    across file systems), so that best.pt here is the best of the whole run whose
    best scores this run continues. Checkpoints are only ever replaced by a rename, never
    written in place, so the two run dirs never write through each other's link."""
    best = best_score(state["progress"])
    src = path.parent / f"best{'.dcp' if path.is_dir() else '.pt'}"
    if best is None or not src.exists():
        return  # nothing validated yet: there is no best to carry
    monitor = loop.checkpoints.monitor
    where = f"resume={wanted}: the best checkpoint so far ({monitor} {best:.4f}) is {src}"
    if src.suffix != loop.checkpointer.suffix:
        if loop.env.is_main:
            log.warning(
                "%s, a %s checkpoint; this run writes %s ones, so it stays there (score it with "
                "`accel-eval ckpt_path=%s`) and this run's best%s holds only bests above it.",
                where,
                "sharded" if src.is_dir() else "single-file",
                "sharded" if loop.checkpointer.sharded else "single-file",
                src,
                loop.checkpointer.suffix,
            )
        return
    src_best = best_score(read_checkpoint(src)["progress"])
    if src_best != best:
        if loop.env.is_main:
            log.warning(
                "%s but that file now holds %s %s (that run went on after the checkpoint you "
                "resume from): not carried over; this run's best%s holds only bests beyond %.4f.",
                where,
                monitor,
                src_best,
                loop.checkpointer.suffix,
                best,
            )
        return
    dst = loop.ckpt_dir / f"best{loop.checkpointer.suffix}"
    loop.checkpoints.carried_best()
    if loop.env.is_main:
        link_or_copy(src, dst)
        log.info("best checkpoint (%s %.4f) carried over from %s to %s", monitor, best, src, dst)
    loop.env.barrier()
