"""A distillation teacher from a run's checkpoint: the build step hands this to
techniques/distill.py, so that the technique layer never imports run_checkpoint.py (the layer
above it, which opens a run's checkpoint as every tool does)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from accel_train.errors import UserError
from accel_train.run_checkpoint import RunCheckpoint
from accel_train.techniques.distill import classes_message, data_args, sha256_path


def teacher_from_checkpoint(path: Path, shape: tuple[int, int, int]) -> tuple[nn.Module, dict]:
    """The teacher rebuilt from its checkpoint's own config (its LoRA adapters included), its
    weights loaded (weights-only), for the student's (in_channels, image_size, num_classes)."""
    opened = RunCheckpoint(path, key="distill.teacher")
    cfg = opened.cfg
    in_channels, image_size, num_classes = shape
    recorded = cfg.dataset.get("num_classes")
    if recorded is not None and recorded != num_classes:
        raise UserError(classes_message(path, f"{recorded} classes", num_classes))

    def fit_error(err: RuntimeError) -> UserError:
        first = str(err).strip().splitlines()
        detail = " ".join(first[1:2] or first[:1]).strip()[:200]
        if "size mismatch" in str(err):
            return UserError(
                f"distill.teacher={path}: the teacher's weights do not fit its model built "
                f"for the student's data ({num_classes} classes, {in_channels}x{image_size}x"
                f"{image_size} inputs; {detail}). A teacher must take the student's inputs "
                "and predict the same classes: train it on the student's data set (or one "
                "of the same shape and classes), or give another `distill.teacher`."
            )
        return UserError(
            f"distill.teacher={path}: its weights do not fit the model its config builds "
            f"(model._target_={cfg.model._target_}; {detail}). Has the model's code changed "
            "since the teacher was trained?"
        )

    def build_error(err: UserError) -> UserError:
        return UserError(f"distill.teacher={path}: rebuilding the teacher failed: {err}")

    teacher = opened.model(data_args(shape), fit_error=fit_error, build_error=build_error)
    return teacher, {"teacher": str(path.resolve()), "sha256": sha256_path(path)}
