"""distill: knowledge distillation from a teacher (Hinton et al., 2015).

The training loss becomes ``alpha * hard + (1 - alpha) * T^2 * KL(softmax(t/T) || softmax(s/T))``
(``s``, ``t``: the student's and the teacher's logits; ``hard``: the run's own loss on the
labels). Validation and test score the hard loss only.

The teacher is either a checkpoint written by accel-train (``distill.teacher=<path>``), rebuilt
from the checkpoint's own recorded config (its ``model._target_``, a user's model included, as
``accel-eval`` does) and loaded with torch's weights-only unpickler (loading never runs code from
the file); a folder timm's ``save_for_hf`` wrote (``distill.teacher=<folder>``: model=timm builds
the architecture its config.json names, with the folder's weights); or any model by ``_target_``
(``+distill.teacher._target_=pkg.make_teacher``, or a model source with its ``name`` and
``weights``: it must bring its own weights, and a head that fits the student's classes). It gets
the student's input shape and number of classes, runs on the same device and parameter dtype, in
eval mode, without gradients, under the loop's autocast, on the same (augmented) micro-batch, and
is never wrapped in DDP: each rank holds a copy. It is not part of the student: it is not in the
student's checkpoints, only recorded there (path and sha256 in the technique state, and in
summary.json); a resume with another teacher file warns.

The student's logits are taken from the training forward itself (a forward hook on the training
model that keeps the output of the last forward with gradients), so distillation wraps whatever
computes the loss (e.g. selective backprop's selected samples) without a second forward.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from accel_train.errors import UserError
from accel_train.models import build_model
from accel_train.models.timm import read_folder_config, timm_model
from accel_train.techniques import PREPARE, BuildContext, LossFn, Technique

log = logging.getLogger("accel_train")


# A checkpoint's path and the student's (in_channels, image_size, num_classes) -> the teacher
# and what identifies it ({"teacher": ..., "sha256": ...}).
TeacherOpener = Callable[[Path, tuple[int, int, int]], tuple[nn.Module, dict]]


class Distill(Technique):
    name = "distill"
    order = PREPARE  # builds the teacher at build time, beside the student (not a transform)

    def __init__(
        self,
        teacher: Any,
        from_checkpoint: TeacherOpener,
        alpha: float = 0.5,
        temperature: float = 4.0,
    ):
        self.source, self.alpha, self.temperature = teacher, alpha, temperature
        # The build step hands in how a run's checkpoint becomes a model (train/teacher.py):
        # opening one is a question for the layer above techniques (run_checkpoint.py).
        self.from_checkpoint = from_checkpoint
        self.teacher: nn.Module | None = None
        self.record: dict[str, Any] = {}  # what identifies the teacher (checkpoint, summary)
        self._student: torch.Tensor | None = None
        self._handle: Any = None
        self._soft_sum: torch.Tensor | None = None  # soft losses since the last log, on the device
        self._soft_count = 0

    # ---- build --------------------------------------------------------------------------

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        sample = ctx.sample
        with torch.no_grad():
            was_training = model.training
            model.eval()
            student_out = model(sample)
            model.train(was_training)
        num_classes = student_out.shape[1]
        shape = (sample.shape[1], sample.shape[-1], num_classes)
        param = next(model.parameters(), None)
        dtype = param.dtype if param is not None else torch.float32
        if isinstance(self.source, str) and read_folder_config(self.source).get("architecture"):
            teacher, self.record = _from_timm_folder(Path(self.source).expanduser(), shape)
        elif isinstance(self.source, str):
            teacher, self.record = self.from_checkpoint(Path(self.source).expanduser(), shape)
        else:
            teacher, self.record = _from_target(self.source, shape)
        teacher = teacher.to(sample.device, dtype=dtype).eval().requires_grad_(False)
        with torch.no_grad():
            try:
                out = teacher(sample)
            except Exception as err:
                raise UserError(
                    f"distill.teacher={self.record['teacher']}: the teacher's forward failed on "
                    f"the student's batch of shape {tuple(sample.shape)}: {type(err).__name__}: "
                    f"{' '.join(str(err).split())[:300]}. A teacher must take the student's inputs."
                ) from None
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[1] != num_classes:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise UserError(
                f"distill.teacher={self.record['teacher']}: the teacher returned {got} for a batch "
                f"of {sample.shape[0]}, but the student predicts {num_classes} classes: a teacher "
                "must output logits over the student's classes, (batch, num_classes)."
            )
        self.teacher = teacher
        return model

    # ---- the loss -----------------------------------------------------------------------

    def wrap_loss(self, loop: Any, compute: LossFn) -> LossFn:
        self._handle = loop.model.register_forward_hook(self._capture)
        alpha, temp = self.alpha, self.temperature

        task = loop.task

        def distilled(batch: Any) -> Any:
            self._student = None
            hard, items = compute(batch)
            student, self._student = self._student, None
            if student is None:  # a wrapper inside this one did not run the training model
                raise RuntimeError("distill: the loss was computed without the training model")
            with torch.no_grad():
                teacher = self.teacher(task.inputs(batch))
            soft = F.kl_div(
                F.log_softmax(student.float() / temp, dim=1),
                F.log_softmax(teacher.float() / temp, dim=1),
                reduction="batchmean",
                log_target=True,
            ) * (temp * temp)
            self._soft_sum.add_(soft.detach())
            self._soft_count += 1
            return alpha * hard + (1 - alpha) * soft, items

        return distilled

    def _capture(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor):
            self._student = output  # the training forward (validation runs without grad)

    def on_fit_start(self, loop: Any) -> None:
        self._soft_sum = torch.zeros((), device=loop.env.device)
        if loop.env.is_main:
            log.info(
                "distill: teacher %s (sha256 %s), alpha %g, temperature %g",
                self.record["teacher"],
                self.record["sha256"][:12],
                self.alpha,
                self.temperature,
            )

    def on_log(self, loop: Any, metrics: dict[str, float]) -> None:
        if self._soft_count:
            # HOST SYNC (logging step): this rank's mean soft loss since the last log.
            metrics["distill/soft_loss"] = self._soft_sum.item() / self._soft_count
            self._soft_sum.zero_()
            self._soft_count = 0

    def on_fit_end(self, loop: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def summary(self, loop: Any) -> dict[str, Any]:
        return {
            "distill": {
                "teacher": self.record.get("teacher"),
                "teacher_sha256": self.record.get("sha256"),
                "alpha": self.alpha,
                "temperature": self.temperature,
            }
        }

    def state_dict(self) -> dict[str, Any]:
        return dict(self.record)  # the teacher's identity only, never its weights

    def load_state_dict(self, state: dict[str, Any]) -> None:
        old = state.get("sha256")
        if old and old != self.record.get("sha256"):
            log.warning(
                "distill: the checkpoint was trained with teacher %s (sha256 %s); this run "
                "distills from %s (sha256 %s) from the resumed step on",
                state.get("teacher"),
                old[:12],
                self.record.get("teacher"),
                self.record.get("sha256", "")[:12],
            )


def classes_message(path: Path, what: str, num_classes: int) -> str:
    return (
        f"distill.teacher={path}: the teacher was trained on {what}, the student on "
        f"{num_classes}: a teacher must predict the same classes as the student. Train the "
        "teacher on the student's data set (or one with the same classes), or give another "
        "`distill.teacher`."
    )


def _from_timm_folder(path: Path, shape: tuple[int, int, int]) -> tuple[nn.Module, dict]:
    """A teacher saved by timm (`save_for_hf`: config.json naming the architecture, and the
    weights): built by model=timm for the student's data, its weights loaded."""
    arch = read_folder_config(str(path))["architecture"]
    node = OmegaConf.create({"_target_": f"{timm_model.__module__}.timm_model", "name": arch})
    node.weights = str(path)
    teacher, record = _from_target(node, shape)
    return teacher, {**record, "teacher": f"{path.resolve()} (timm {arch})"}


def _from_target(node: DictConfig, shape: tuple[int, int, int]) -> tuple[nn.Module, dict]:
    try:
        teacher = build_model(node, data_args(shape))
    except UserError as err:
        raise UserError(f"distill.teacher._target_={node._target_}: {err}") from None
    if getattr(teacher, "fresh_head", None):  # model.weights re-initialised its classifier
        raise UserError(
            classes_message(
                Path(str(node.weights)), "other classes (its head does not fit)", shape[2]
            )
        )
    digest = hashlib.sha256()
    for name, tensor in sorted(teacher.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    # (a model source's architecture and weights name it better than its builder alone)
    named = " ".join(str(node[k]) for k in ("name", "weights") if node.get(k))
    shown = f"{node._target_} ({named})" if named else str(node._target_)
    return teacher, {"teacher": shown, "sha256": digest.hexdigest()}


def data_args(shape: tuple[int, int, int]) -> dict:
    """The student's input shape and classes, as its Splits.data_args gave them to it."""
    return dict(zip(("in_channels", "image_size", "num_classes"), shape, strict=True))


def sha256_path(path: Path) -> str:
    """The file's sha256 (an FSDP .dcp directory: over its files, by name)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
