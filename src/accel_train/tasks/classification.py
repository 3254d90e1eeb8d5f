"""task=classification (the default): `model(x)` gives class logits `(batch, classes)`, the loss
is the `loss` group's module (cross-entropy by default) on the labels; logs loss and accuracy
(top-1 as `acc`; `acc_top5` too by default with 10 classes or more, as timm logs it;
`task.top_k=[1]` or `[1,3]` chooses).

Soft targets (issue 38): with the dataset's batch switches (data/images/batch_mix.py) a training
batch is (x, soft targets float [B, C], labels), and the loss is the `loss` module on the soft
targets: torch's CrossEntropyLoss takes class probabilities, which is timm's
SoftTargetCrossEntropy (-sum p log softmax, the batch mean). The loss's label_smoothing is
folded into mixup's targets (timm's Mixup label_smoothing), so the loss itself is built without
it. train/acc stays the top-1 on the hard labels; validation and test never mix.

Evaluation batches with several views of each sample (a video's clips x crops: the data's
evaluation items are (V, C, T, H, W), data/transform.py hands N * V clips to the model) are
scored per sample by the mean of its views' softmax, the standard multi-view test: val/acc is
then the video accuracy, val/clip_acc each clip's own top-1.

Accuracy per group (issue 64): where the data scores a per-sample field apart (Splits.groups, a
radio set's SNR), evaluation items carry the group's index as a third element and the task
logs `acc_<name>/<value>` (val/acc_snr/10: the accuracy of the bursts at +10 dB), counted on the
device, one sum per group declared at setup so every rank packs the same ones."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from accel_train.config import task_facts as facts
from accel_train.config.schema import ClassificationTaskConfig
from accel_train.data.images.batch_mix import BatchMix, build_batch_mix, mixing_on
from accel_train.errors import UserError
from accel_train.losses import build_loss
from accel_train.models import check_output
from accel_train.plugins import register_task
from accel_train.tasks.base import Task, TaskContext
from accel_train.tasks.predictions import Predictions

log = logging.getLogger("accel_train")
# With this many classes or more, top-5 accuracy is logged by default (timm's train.py logs
# top-1 and top-5 on ImageNet); below it, top-5 is close to 1 and says little.
TOP5_FROM = 10


@register_task("classification", ClassificationTaskConfig)
class Classification(facts.Classification, Task):
    def __init__(self, top_k: list[int] | tuple[int, ...] | None = None):
        super().__init__()
        # None: top-1, and top-5 with >= TOP5_FROM classes (timm's train.py logs both), decided
        # in setup, when the classes are known.
        self.top_k = None if top_k is None else [int(k) for k in top_k]
        self.loss_fn: nn.Module | None = None
        self.loss_cfg: DictConfig | None = None
        self.num_classes = 0
        self.transform: Any = None
        self.device: torch.device | None = None
        self.mix: BatchMix | None = None  # the batch switches on training batches (or None)
        self.group_names: list[str] = []  # acc_<group>/<value>, one per group (Splits.groups)
        self.kept: Predictions | None = None  # accel-eval's per-item predictions (or None)

    def setup(self, ctx: TaskContext) -> None:
        if ctx.num_classes < 2:
            raise UserError(
                f"the data set has {ctx.num_classes} class(es): a classifier needs at least 2 "
                "(with one, the loss is 0 and the accuracy 1 whatever the weights). Check the "
                "data or set `dataset.num_classes`."
            )
        if ctx.warn and 0 < ctx.val_samples < ctx.num_classes:
            log.warning(
                "validation scores only %d samples for %d classes: val/acc (and the choice of "
                "best.pt) is mostly noise. Raise dataset.val_fraction or trainer.limit_val_batches",
                ctx.val_samples,
                ctx.num_classes,
            )
        if self.top_k is None:
            self.top_k = [1, 5] if ctx.num_classes >= TOP5_FROM else [1]
        if not self.top_k or any(k < 1 or k > max(ctx.num_classes, 1) for k in self.top_k):
            raise UserError(
                f"task.top_k={self.top_k}: each k must be in [1, {ctx.num_classes}] (the number "
                "of classes), e.g. `task.top_k=[1,5]`."
            )
        self.num_classes, self.transform, self.device = ctx.num_classes, ctx.transform, ctx.device
        self.loss_cfg, smoothing = _folded_smoothing(ctx.cfg.loss, ctx.cfg.dataset, ctx.warn)
        self.loss_fn = build_loss(self.loss_cfg, ctx.num_classes).to(ctx.device)
        self.mix = build_batch_mix(
            ctx.cfg.dataset,
            ctx.num_classes,
            smoothing,
            seed=ctx.cfg.trainer.seed,
            rank=getattr(ctx.transform, "rank", 0),
            device=ctx.device,
        )
        if self.mix is not None and self.mix.soft_targets:
            self._check_soft_loss()
        super().setup(ctx)
        groups = getattr(ctx.splits, "groups", None)
        self.group_names = [groups.metric(i) for i in range(len(groups.values))] if groups else []
        for name in self.group_names:
            self.eval_metrics.declare(name, ctx.device)
        x = ctx.prepared(self)[0]
        check_output(ctx.model, x, ctx.num_classes, ctx.cfg.model._target_)

    def _check_soft_loss(self) -> None:
        """The loss must take soft targets (float [B, C] class probabilities), as torch's
        CrossEntropyLoss does: probed on a batch of 2 (any failure of the user's module is
        the answer, hence the broad except)."""
        c = self.num_classes
        try:
            out = self.loss_fn(torch.zeros(2, c, device=self.device),
                               torch.full((2, c), 1 / c, device=self.device))  # fmt: skip
            why = None if isinstance(out, torch.Tensor) and out.dim() == 0 else f"returned {out!r}"
        except Exception as err:  # noqa: BLE001 - the user's loss: any error means "cannot"
            why = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        if why is not None:
            raise UserError(
                f"dataset.mixup_alpha/cutmix_alpha train on soft targets (class probabilities, "
                f"float [batch, classes]), and loss._target_={self.loss_cfg._target_} does not "
                f"take them ({why}). Use `loss=cross_entropy` (torch's CrossEntropyLoss takes "
                "probabilities: timm's SoftTargetCrossEntropy), make your loss take them, or "
                "turn mixing off (`dataset.mixup_alpha=0 dataset.cutmix_alpha=0`)."
            )

    def prepare(self, batch: Any, *, train: bool, epoch: int = 0, index: int = 0) -> Any:
        images, labels, *group = batch  # (group: evaluation items of Splits.groups)
        x = self.transform(images, train=train, epoch=epoch, batch=index)
        if train and self.mix is not None:  # (x, labels) or (x, soft targets, labels)
            return self.mix(x, labels, epoch, index)
        return (x, labels, *group) if not train else (x, labels)

    def inputs(self, batch: Any) -> Any:
        return batch[0]

    def step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, target, labels = batch[0], batch[1], batch[-1]  # target: labels or soft targets
        logits = model(x)
        if logits.dim() == 2 and labels.dim() == 1:  # class scores and class indices
            with torch.no_grad():
                # train/acc, counted on the device (no host sync), read at the logging step.
                correct = (logits.argmax(1) == labels).sum()
            self.train_metrics.add("acc", correct, labels.shape[0])
        return self.loss_fn(*_loss_args(logits, target))

    # ---- what techniques and the pipeline ask of a classifier ---------------------------

    def loss_split(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): the pipeline runs model(inputs) over its stages and the loss on
        the last one (targets: the labels, or the soft targets of a mixed batch)."""
        return batch[0], batch[1]

    def per_sample(self) -> Callable[[nn.Module, Any], torch.Tensor]:
        """A function (model, batch) -> the loss of each sample, shape (batch,): selective
        backprop's score. The loss is rebuilt with reduction='none' and checked here."""
        target = self.loss_cfg._target_
        key = "selective_backprop"
        try:
            per_sample = build_loss(self.loss_cfg, self.num_classes, reduction="none")
        except UserError as err:
            raise UserError(
                f"{key} needs the loss of each sample, but the loss could not be built with "
                f"reduction='none' ({err}). Give loss._target_={target} a `reduction` argument "
                "as torch's losses have, or turn selective backprop off "
                "(`selective_backprop.keep=1`)."
            ) from None
        if per_sample is None:
            raise UserError(
                f"{key} needs the loss of each sample, but loss._target_={target} takes no "
                "`reduction` argument. Give its constructor `reduction='mean'` and return the "
                "per-sample losses when it is 'none' (as torch's losses do), or turn selective "
                "backprop off (`selective_backprop.keep=1`)."
            )
        per_sample = per_sample.to(self.device)
        logits = torch.zeros(2, self.num_classes, device=self.device)
        labels = torch.zeros(2, dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = per_sample(logits, labels)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2,):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise UserError(
                f"{key} needs the loss of each sample: loss._target_={target} with "
                f"reduction='none' returned {got} for a batch of 2, not one value per sample. "
                "Make it return shape (batch,) when reduction='none', or turn selective "
                "backprop off (`selective_backprop.keep=1`)."
            )

        def score(model: nn.Module, batch: Any) -> torch.Tensor:
            return per_sample(*_loss_args(model(batch[0]), batch[1]))

        return score

    # ---- evaluation ----------------------------------------------------------------------

    def evaluate(
        self,
        model: nn.Module,
        batch: Any,
        valid: int,
        autocast: Callable[[], AbstractContextManager],
    ) -> None:
        images, labels = batch[0], batch[1]
        with autocast():
            logits = model(images)
        # Several views of each sample (a video's clips x crops, data/transform.py): N * V rows.
        views = logits.shape[0] // max(labels.shape[0], 1)
        if views > 1:
            self.eval_metrics.declare("clip_acc", logits.device)  # (a padding-only rank too)
        k = valid
        if k == 0:
            return  # all padding: the forward still ran, as collectives in it require
        if views > 1:
            logits = self._video_scores(logits[: k * views].float(), labels[:k], views)
        logits, labels = logits[:k].float(), labels[:k]
        m = self.eval_metrics
        m.add("loss", self.loss_fn(logits, labels).double() * k, k)
        m.add("acc", (logits.argmax(1) == labels).sum(), k)
        for top in self.top_k:
            if top != 1:
                hits = (logits.topk(top, dim=1).indices == labels[:, None]).any(1).sum()
                m.add(f"acc_top{top}", hits, k)
        if self.group_names and len(batch) > 2:
            self._group_accuracy(logits.argmax(1) == labels, batch[2][:k])
        if self.kept is not None:  # (accel-eval only: a host read)
            self.kept.add(logits, labels)

    def keep_predictions(self) -> Predictions:
        """Each item's prediction from now on: a video's is its views' averaged one."""
        self.kept = Predictions()
        return self.kept

    def _group_accuracy(self, correct: torch.Tensor, group: torch.Tensor) -> None:
        """acc_<group>/<value>: hits and samples per group, summed on the device (no host read:
        the counts are device counts). A one-hot product rather than bincount/index_add_, whose
        CUDA kernels are refused under trainer.deterministic (atomic adds)."""
        n = len(self.group_names)
        onehot = torch.nn.functional.one_hot(group, n).double()  # (batch, groups)
        hits, counts = correct.double() @ onehot, onehot.sum(0)
        for i, name in enumerate(self.group_names):
            self.eval_metrics.add(name, hits[i], counts[i])

    def _video_scores(self, logits: torch.Tensor, labels: torch.Tensor, views: int):
        """The multi-view test: per video (sample) the mean of its views' softmax, returned as
        log-probabilities (so the loss is the cross-entropy of the averaged prediction and the
        accuracy the video accuracy); each view's own top-1 is logged as `clip_acc`.

        The log of the mean is taken by logsumexp of the views' log-softmax, not as the log of
        the averaged probabilities: those underflow to 0 for a confident wrong prediction, and
        a clamp there (1e-12) capped every such video's loss at 27.63, hiding how wrong the
        evaluation-mode model was (a model with BatchNorm statistics of a few batches)."""
        per_view = logits.view(labels.shape[0], views, -1)
        hits = (per_view.argmax(2) == labels[:, None]).sum()
        self.eval_metrics.add("clip_acc", hits, labels.shape[0] * views)
        return per_view.log_softmax(2).logsumexp(1) - math.log(views)


def _loss_args(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft targets (float32) with float32 logits: a bf16 copy of the targets would round the
    smoothed probabilities (e.g. 0.9125); the [B, C] cast is cheap next to the model."""
    if target.is_floating_point():
        return logits.float(), target.float()
    return logits, target


def _folded_smoothing(loss: DictConfig, ds: DictConfig, warn: bool) -> tuple[DictConfig, float]:
    """(the loss config to build, mixup's label smoothing): with mixup/cutmix on, the loss's
    label_smoothing moves into the mixed targets (timm's Mixup smooths them) and the loss is
    built with 0, so the targets are not smoothed twice."""
    smoothing = float(loss.get("label_smoothing") or 0.0)
    if not mixing_on(ds) or "label_smoothing" not in loss:
        return loss, 0.0
    if warn and smoothing:
        log.info(
            "loss.label_smoothing=%g is folded into mixup/cutmix's soft targets (timm's Mixup "
            "label_smoothing); the loss itself is built without it",
            smoothing,
        )
    return OmegaConf.merge(loss, {"label_smoothing": 0.0}), smoothing
