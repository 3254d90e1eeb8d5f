"""Checks of a composed config that types alone cannot express: each raises a UserError that
names the key and the fix."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from accel_train.config.schema import OPTION_SCHEMAS
from accel_train.errors import UserError

# Groups whose option is chosen by `name` (the others build user code by `_target_`).
NAMED_GROUPS = ("precision", "strategy", "launcher", "loader", "optimizer", "scheduler", "logger")

# Keys with a fixed set of values.
CHOICES: dict[str, tuple[str, ...]] = {
    "strategy.backend": ("auto", "nccl", "gloo"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.progress": ("auto", "rich", "plain", "none"),
}

# summary.json keys a sweep may optimise (`objective`), with the direction that is better.
OBJECTIVES: dict[str, str] = {
    "best_val_acc": "maximize",
    "final_val_acc": "maximize",
    "final_val_loss": "minimize",
    "test_acc": "maximize",
    "train_samples_per_s": "maximize",
    "wall_s": "minimize",
}

# key: (minimum, what the key means) for integers that must be at least that.
MINIMUMS: dict[str, tuple[int, str]] = {
    "loader.batch_size": (1, "samples per device per micro-batch"),
    "loader.eval_batch_size": (0, "0 means the same as loader.batch_size"),
    "loader.num_workers": (0, "0 loads in the main process"),
    "trainer.accumulate_grad_batches": (1, "1 means no accumulation"),
    "trainer.log_every_n_steps": (1, "optimizer steps between metric lines"),
    "trainer.val_every_n_epochs": (1, "epochs between validations"),
    "trainer.ckpt_every_n_steps": (0, "0 saves only at the end of each epoch"),
    "trainer.limit_train_batches": (0, "0 means no limit"),
    "trainer.limit_val_batches": (0, "0 means no limit"),
    "trainer.profile_steps": (1, "steps recorded by the profiler"),
}


def validate(cfg: DictConfig) -> None:
    """Raises UserError naming the key and the fix."""
    if cfg.strategy.name == "dp":
        raise UserError(
            "strategy=dp (torch.nn.DataParallel) is not supported: it drives all GPUs from one "
            "Python process, scatters inputs and gathers outputs through GPU 0 every step, and is "
            "slower than DistributedDataParallel even on a single node (PyTorch's docs say so). "
            "Use `strategy=ddp launcher.nproc_per_node=auto` (one process per GPU)."
        )
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        raise UserError(
            f"{key} is required (it is ??? in the config) but was not given. Set it on the "
            f"command line, e.g. `{key}=...`"
            + (" (the dotted path of your class or function)." if key.endswith("_target_") else ".")
        )
    for group in NAMED_GROUPS:
        allowed = tuple(OPTION_SCHEMAS[group])
        if cfg[group].name not in allowed:
            raise UserError(
                f"{group}.name={cfg[group].name!r} is not one of {', '.join(allowed)}. "
                f"Pick a {group} option, e.g. `{group}={allowed[0]}`."
            )
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise UserError(f"{key}={value!r} is not one of {', '.join(allowed)}.")
    for key, (minimum, meaning) in MINIMUMS.items():
        value = OmegaConf.select(cfg, key, default=minimum)
        if value < minimum:
            fix = f"`{key}={max(minimum, 1)}`"
            raise UserError(f"{key}={value} must be >= {minimum} ({meaning}). Set e.g. {fix}.")
    for group in ("model", "dataset", "loss"):
        if not isinstance(cfg[group], DictConfig) or "_target_" not in cfg[group]:
            raise UserError(
                f"{group} has no _target_: every {group} option names the class or factory that "
                f"builds it. Pick an option (`{group}=custom {group}._target_=my_pkg.module.Name`)."
            )
    t = cfg.trainer
    if t.max_epochs < 1 and t.max_steps < 1:
        raise UserError(
            f"trainer.max_epochs={t.max_epochs} and trainer.max_steps={t.max_steps}: nothing to "
            "train. Set `trainer.max_epochs=1` or more, or `trainer.max_steps=1` or more."
        )
    if t.gradient_clip_val < 0:
        raise UserError(
            f"trainer.gradient_clip_val={t.gradient_clip_val} must be >= 0 (0 turns clipping off)."
        )
    if cfg.optimizer.lr <= 0:
        raise UserError(f"optimizer.lr={cfg.optimizer.lr} must be > 0, e.g. `optimizer.lr=1e-3`.")
    if cfg.loader.name == "torch" and cfg.loader.prefetch_factor < 1:
        raise UserError("loader.prefetch_factor must be >= 1 (batches loaded ahead per worker).")
    if not 0 <= cfg.dataset.get("val_fraction", 0.1) < 1:
        raise UserError(
            f"dataset.val_fraction={cfg.dataset.val_fraction} must be in [0, 1): the share of the "
            "training data held out for validation, e.g. `dataset.val_fraction=0.1`."
        )
    if cfg.objective not in OBJECTIVES:
        raise UserError(
            f"objective={cfg.objective!r} is not a summary.json metric: pick one of "
            f"{', '.join(OBJECTIVES)} (e.g. `objective=best_val_acc`)."
        )
    # A checkpoint is a .pt file, or (FSDP) a .dcp directory holding meta.pt.
    if cfg.resume not in (None, "auto") and not (
        Path(cfg.resume).is_file() or (Path(cfg.resume) / "meta.pt").is_file()
    ):
        raise UserError(
            f"resume={cfg.resume!r}: no such checkpoint. Give a path to a .pt file (or an FSDP "
            ".dcp directory) written by accel-train, or `resume=auto` to continue from the run "
            "directory's last checkpoint."
        )
