"""What a run says about itself: the announcement before the first step (model, data, batch,
techniques, resume point) and the end (summary.json and the `done:` line). Reads the loop; the
loop keeps only the training itself."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from accel_train.config.facts import batches_note
from accel_train.config.recipe_checks import recipe_switches
from accel_train.loggers import json_safe
from accel_train.train.build import make_loader
from accel_train.train.evaluate import score

log = logging.getLogger("accel_train")


def announce(loop: Any, resumed_from: str | None) -> None:
    if not loop.env.is_main:
        return
    p, loader_cfg, strategy = loop.parts, loop.cfg.loader, loop.strategy
    # An optimizer that computes in a dtype of its own (Muon's Newton-Schulz) says which.
    own_dtype = getattr(loop.optimizer, "describe", None)
    log.info(
        "model %s (%s) on %s; precision %s%s; data %s: %d train / %d val / %s test",
        loop.cfg.model.get("name", loop.cfg.model._target_),
        parameters_text(strategy.parameter_count(loop.module), loop.module),
        loop.env.device,
        loop.precision.describe(),
        f"; {own_dtype()}" if callable(own_dtype) else "",
        loop.cfg.dataset.get("name", "custom"),
        len(p.splits.train),
        len(p.splits.val),
        len(p.splits.test) if p.splits.test is not None else "no",
    )
    log.info(
        "batch: %d per device x %d accumulation x %d process(es)%s = %d global; "
        "%d optimizer steps (%d per epoch, %d epochs; %s ends the run at step %d); loader=%s",
        loader_cfg.batch_size,
        loop.accum,
        loop.data_world,
        strategy.describe_processes(loop.env.world_size),
        p.global_batch,
        p.total_steps,
        p.steps_per_epoch,
        p.max_epochs,
        ending_limit(loop.cfg.trainer, p.total_steps),
        p.total_steps,
        loader_cfg.name,
    )
    weights = weights_text(loop.cfg.model, resumed_from)
    if weights:
        log.info("%s", weights)
    names = [t.name for t in loop.techniques] + recipe_switches(loop.cfg)
    if names:
        log.info("techniques: %s", ", ".join(names))
    if resumed_from:
        log.info("resumed from %s at epoch %d, step %d", resumed_from, loop.epoch, loop.step)


# The model sources that build an architecture by name, never downloading its weights.
BY_NAME = {
    "accel_train.models.timm.timm_model": "timm",
    "accel_train.models.torchvision.torchvision_model": "torchvision",
}


def weights_text(model: Any, resumed_from: str | None) -> str | None:
    """`model: timm resnet18, random weights` (or `weights from <path>`): whether a model
    built by name starts from trained weights, which a newcomer cannot tell from its name."""
    source = BY_NAME.get(str(model.get("_target_", "")))
    if source is None:
        return None
    head = f"model: {source} {model.get('name')}"
    if resumed_from:
        return f"{head}, weights from {resumed_from} (resumed)"
    if model.get("weights"):
        return f"{head}, weights from {model.weights}"
    return (
        f"{head}, random weights (pretrained ones are never downloaded: "
        "`model.weights=<file or folder>` starts from them)"
    )


def ending_limit(trainer: Any, total_steps: int) -> str:
    """Which of trainer.max_steps and trainer.max_epochs ends the run (the first reached)."""
    if trainer.max_steps > 0 and total_steps == trainer.max_steps:
        return f"trainer.max_steps={trainer.max_steps}"
    return f"trainer.max_epochs={trainer.max_epochs}"


def parameters_text(total: int, module: Any) -> str:
    """`N parameters`, split into trainable and frozen (LoRA's base, model.freeze) as PEFT's
    print_trainable_parameters does. `total`: the strategy's count of the whole model (a
    pipeline stage's module holds only its part: then the split is not known here)."""
    params = list(module.parameters())
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    if sum(p.numel() for p in params) != total:
        return f"{total:,} parameters"
    if not frozen:
        return f"{total:,} parameters, all trainable"
    trainable = total - frozen
    return (
        f"{total:,} parameters: {trainable:,} trainable ({trainable / max(total, 1):.2%}), "
        f"{frozen:,} frozen"
    )


def write_summary(
    loop: Any, samples_per_s: float, start: float, test: dict | None
) -> dict[str, Any]:
    """summary.json (rank 0 writes it) and the `done:` line; returns the summary."""
    wall_s = time.perf_counter() - start
    summary = {
        # The best of each validation metric (best_val_acc, best_val_loss, ...).
        **{f"best_val_{name}": value for name, value in loop.best_val.items()},
        "monitor": loop.checkpoints.monitor,
        "monitor_mode": loop.checkpoints.mode,
        "best_score": loop.checkpoints.best,  # the best checkpoint.monitor value
        # Every metric of the last validation (a task's own too), as final_val_<name>.
        **{f"final_val_{k}": v for k, v in (loop.last_val or {}).items()},
        **(test or {}),
        "epochs": loop.epoch,
        "epochs_trained": float(epochs_done(loop)),  # with a step limit's share of the last
        "steps": loop.step,
        "train_samples_per_s": samples_per_s,
        # A language model's tokens/s over the same time (the tokens per sample seen).
        "train_tokens_per_s": (
            samples_per_s * loop.tokens_seen / loop.samples_seen if loop.tokens_seen else None
        ),
        "wall_s": wall_s,
        "precision": loop.precision.describe(),
        "device": str(loop.env.device),
        "world_size": loop.env.world_size,
        "global_batch": loop.parts.global_batch,
        "run_dir": str(loop.run_dir),
        "finished_early": loop.finish_reason,
        "tags": list(loop.cfg.get("tags") or []),
        "checkpoints": str(loop.ckpt_dir),
    }
    for technique in loop.techniques:
        summary.update(technique.summary(loop))
    summary = json_safe(summary)
    if loop.env.is_main:
        text = json.dumps(summary, indent=2, allow_nan=False)
        (loop.run_dir / "summary.json").write_text(text + "\n")
        test_text = "".join(
            f", test/{k[5:]} {v:.4f}"
            for k, v in (test or {}).items()
            if k != "test_ckpt" and k != "test_loss"
        )
        test_text += getattr(loop, "test_note", "") if test_text else ""
        best = loop.checkpoints.best
        tokens = summary["train_tokens_per_s"]
        log.info(
            "done: %d steps, %s epochs, best.pt %s %s%s, %s, %.1f s",
            loop.step,
            epochs_done(loop),
            loop.checkpoints.monitor,
            f"{best:.4f}{batches_note(loop.val_loader)}" if best is not None else "-",
            test_text,
            f"{tokens:.0f} tokens/s" if tokens else f"{samples_per_s:.0f} samples/s",
            wall_s,
        )
    return summary


def epochs_done(loop: Any) -> str:
    """The epochs trained, as the progress lines count them: whole ones, or with the share of
    a last one a step limit cut ("0.5": trainer.max_steps=4 of 8 steps an epoch)."""
    per_epoch = int(getattr(loop.parts, "steps_per_epoch", 0) or 0)
    if per_epoch <= 0 or loop.step <= loop.epoch * per_epoch:
        return str(loop.epoch)
    return f"{loop.step / per_epoch:.3g}"


def test_pass(loop: Any) -> dict[str, Any] | None:
    """Score the checkpoint selected on validation (best, else the final weights) once on
    the test split: the honest number, reported apart from validation."""
    p = loop.parts
    if p.splits.test is None:
        log.info("the data set has no test split: trainer.test_after_fit skipped")
        return None
    best = loop.checkpointer.path("best")
    which = "best" if best.exists() else "last"
    if which == "best":
        loop.checkpointer.load_weights(loop.module, best)
    loader = make_loader(
        p.splits.test,
        loop.cfg,
        loop.env,
        p.splits,
        train=False,
        limit=loop.cfg.trainer.limit_test_batches,
        labelled=loop.task.labelled_data,
    )
    # HOST SYNC (test): one read at the end of the pass.
    scored = score(loop.eval_model, loader, loop.task, loop.precision, loop.env)
    loop.metrics.log(
        {f"test/{name}": value for name, value in scored.items()}, loop.step, loop.epoch
    )
    loop.test_note = batches_note(loader)  # " (1 batch)": limit_test_batches cut the pass
    shown = "  ".join(f"test/{name}={value:.4f}" for name, value in scored.items())
    loop.progress.message(f"test ({which} checkpoint)  {shown}{loop.test_note}")
    return {**{f"test_{name}": value for name, value in scored.items()}, "test_ckpt": which}
