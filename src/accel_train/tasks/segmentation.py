"""task=segmentation: a class per voxel (3-D volumes, dataset=volume_folder) or per pixel (2-D
images, dataset=mask_folder: one patch per image, `val/iou` too) with MONAI's losses, patch
training and sliding-window validation.

- Training batches are (images (B, S, C, X, Y, Z), labels (B, S, 1, X, Y, Z)): B volumes of
  `loader.batch_size`, S = `dataset.samples_per_volume` random patches each; the step runs the
  model on the B x S patches at once. The loop counts B (volumes), so accumulation and the
  logged throughput are in volumes.
- The loss (`task.loss`): `dice_ce` (MONAI's DiceCELoss, the default, as MONAI's fast spleen
  program), `dice` (DiceLoss) or `ce` (DiceCELoss's cross-entropy alone), all on the softmax of
  the logits and the integer labels one-hot encoded (to_onehot_y); `task.include_background`
  counts class 0 in the Dice part.
- Validation scores whole volumes (a batch is a list of them) with MONAI's
  `sliding_window_inference` (`task.roi_size`, default the patch; `task.sw_batch_size`,
  `task.overlap`, `task.sw_mode` constant or gaussian), then the argmax: `val/dice` is the mean
  over the volumes of the mean over the foreground classes, `val/dice/<class>` each class's
  (names from dataset.json), and `val/loss` the loss on the whole volume.
- The one policy for a class absent from both the prediction and the label of a volume: it
  counts as a Dice of 1.0 (nothing to find, nothing found: MONAI's `ignore_empty=False`), in the
  per-class values and in the mean alike. A class absent from the label but predicted counts 0.
  `val/iou` (2-D data) is the mean IoU over the foreground classes under the same policy.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel_train.config import task_facts as facts
from accel_train.config.schema import SegmentationTaskConfig
from accel_train.errors import UserError
from accel_train.plugins import register_task
from accel_train.tasks.base import Task, TaskContext, evaluating

log = logging.getLogger("accel_train")
LOSSES = ("dice_ce", "dice", "ce")
SW_MODES = ("constant", "gaussian")


def _monai():
    try:
        import monai  # noqa: F401 - seconds to import: only for this task
    except ImportError:
        raise UserError(
            "task=segmentation needs MONAI, which is not installed. Install the medical extra: "
            '`pip install "accel-train[medical]"`.'
        ) from None


@register_task("segmentation", SegmentationTaskConfig)
class Segmentation(facts.Segmentation, Task):
    def __init__(
        self,
        loss: str = "dice_ce",
        include_background: bool = True,
        roi_size: list[int] | None = None,
        sw_batch_size: int = 4,
        overlap: float = 0.25,
        sw_mode: str = "constant",
        loss_args: dict | None = None,
    ):
        super().__init__()
        if loss not in LOSSES:
            raise UserError(
                f"task.loss={loss!r} is not one of {', '.join(LOSSES)}, e.g. `task.loss=dice_ce`."
            )
        if sw_mode not in SW_MODES:
            raise UserError(f"task.sw_mode={sw_mode!r}: one of {', '.join(SW_MODES)}.")
        if not 0 <= overlap < 1 or sw_batch_size < 1:
            raise UserError(
                f"task.overlap={overlap} and task.sw_batch_size={sw_batch_size}: the overlap is in "
                "[0, 1) (0.25, MONAI's tutorials), the window batch at least 1."
            )
        _monai()
        self.loss, self.include_background = loss, bool(include_background)
        self.roi_size = None if roi_size is None else [int(r) for r in roi_size]
        self.sw_batch_size, self.overlap, self.sw_mode = int(sw_batch_size), float(overlap), sw_mode
        self.loss_args = dict(loss_args or {})
        self.loss_fn: nn.Module | None = None
        self.spatial_dims = 3  # from the data at setup (dataset=mask_folder: 2)
        self.cases: CaseTable | None = None  # accel-eval's per-case outputs (keep_cases)
        self.classes: list[str] = []

    # ---- build time ----------------------------------------------------------------------

    def setup(self, ctx: TaskContext) -> None:
        k = ctx.num_classes
        if k < 2:
            raise UserError(
                f"task=segmentation: the data set has {k} class(es); a label map needs the "
                "background and at least one class (dataset.json's `labels`)."
            )
        named = getattr(ctx.splits.train, "classes", None) if ctx.splits is not None else None
        self.classes = list(named) if named and len(named) == k else [str(i) for i in range(k)]
        args = ctx.splits.model_args if ctx.splits is not None else {}
        self.spatial_dims = int(args.get("spatial_dims", 3))
        images = ctx.batch[0]
        if isinstance(images, list) or images.dim() != 3 + self.spatial_dims:
            raise UserError(
                "task=segmentation trains on patches: batches of (images (items, patches, "
                "channels, [X,] Y, Z), labels): `dataset=volume_folder` (volumes) and "
                "`dataset=mask_folder` (2-D images) give them (docs/medical.md). This data set "
                f"gives {type(images).__name__} {tuple(getattr(images, 'shape', ()))}."
            )
        if self.roi_size is None:
            self.roi_size = [int(s) for s in images.shape[-self.spatial_dims :]]
        self.loss_fn = self._build_loss()
        super().setup(ctx)
        for name in self.classes[1:]:
            self.eval_metrics.declare(f"dice/{name}", ctx.device)
        if self.spatial_dims == 2:
            self.eval_metrics.declare("iou", ctx.device)
        self._check_model(ctx)
        if ctx.warn and ctx.val_samples:
            b, s = images.shape[:2]
            what = "volumes" if self.spatial_dims == 3 else "images"
            log.info(
                "batch: loader.batch_size=%d %s x dataset.samples_per_volume=%d patches of "
                "%s = %d patches per step and device; validation: whole %s by sliding "
                "window %s (overlap %g, %s)",
                ctx.cfg.loader.batch_size, what, s,
                "x".join(map(str, images.shape[-self.spatial_dims :])),
                ctx.cfg.loader.batch_size * s, what, "x".join(map(str, self.roi_size)),
                self.overlap, self.sw_mode,
            )  # fmt: skip

    def _build_loss(self) -> nn.Module:
        from monai.losses import DiceCELoss, DiceLoss

        args = {"to_onehot_y": True, "softmax": True,
                "include_background": self.include_background, **self.loss_args}  # fmt: skip
        if self.loss == "ce":
            args["lambda_dice"] = 0.0
        cls = DiceLoss if self.loss == "dice" else DiceCELoss
        try:
            return cls(**args)
        except (TypeError, ValueError) as err:
            raise UserError(
                f"task.loss={self.loss} with task.loss_args={self.loss_args}: MONAI's "
                f"{cls.__name__} refused them ({err}). Fix task.loss_args."
            ) from None

    def _check_model(self, ctx: TaskContext) -> None:
        x = self.inputs(ctx.prepared(self))
        target = ctx.cfg.model._target_
        try:
            with evaluating(ctx.model):
                out = ctx.model(x)
        except Exception as err:  # the model's forward on the data's real shape
            raise UserError(
                f"model._target_={target}: its forward failed on patches of shape "
                f"{tuple(x.shape)}: {type(err).__name__}: {' '.join(str(err).split())[:300]}. "
                "A U-Net needs each patch side divisible by 2^(levels-1): set "
                "`dataset.patch_size` accordingly (or pick model=monai model.name=UNet)."
            ) from None
        want = (x.shape[0], ctx.num_classes, *x.shape[2:])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise UserError(
                f"model._target_={target}: task=segmentation needs logits of shape (patches, "
                f"classes, X, Y, Z) = {want}, and the model returned {got}. Use a segmentation "
                "network (`model=monai model.name=UNet`), whose out_channels are the classes."
            )

    # ---- the step ------------------------------------------------------------------------

    def prepare(self, batch: Any, *, train: bool, epoch: int = 0, index: int = 0) -> Any:
        images, labels = batch
        if isinstance(images, list):  # whole volumes (validation)
            return [x.to(self.param_dtype) for x in images], [y.long() for y in labels]
        return images.to(self.param_dtype), labels.long()

    def inputs(self, batch: Any) -> Any:
        images = batch[0]
        return images[0][None] if isinstance(images, list) else images.flatten(0, 1)

    def step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        images, labels = batch
        logits = model(images.flatten(0, 1))
        return self.loss_fn(logits.float(), labels.flatten(0, 1))

    # ---- evaluation ----------------------------------------------------------------------

    def evaluate(
        self,
        model: nn.Module,
        batch: Any,
        valid: int,
        autocast: Callable[[], AbstractContextManager],
    ) -> None:
        from monai.inferers import sliding_window_inference
        from monai.metrics import compute_dice, compute_iou
        from monai.networks.utils import one_hot

        images, labels = batch
        k = len(self.classes)
        m = self.eval_metrics
        for i in range(max(valid, 1)):  # (all padding: still one forward, as a collective may need)
            x, y = images[i][None], labels[i][None]
            with autocast():
                logits = sliding_window_inference(
                    x, self.roi_size, self.sw_batch_size, model,
                    overlap=self.overlap, mode=self.sw_mode,
                )  # fmt: skip
            if valid == 0:
                return
            logits = logits.as_tensor() if hasattr(logits, "as_tensor") else logits
            logits = logits.float()
            m.add("loss", self.loss_fn(logits, y).double(), 1)
            pred = logits.argmax(1, keepdim=True)
            # ignore_empty=False: a class absent from both prediction and label counts 1.0.
            dice = compute_dice(one_hot(pred, k), one_hot(y, k), include_background=False,
                                ignore_empty=False)[0].double()  # fmt: skip
            m.add("dice", dice.mean(), 1)
            for name, value in zip(self.classes[1:], dice, strict=True):
                m.add(f"dice/{name}", value, 1)
            iou = None
            if self.spatial_dims == 2:  # mean IoU over the foreground classes, the same policy
                iou = compute_iou(one_hot(pred, k), one_hot(y, k), include_background=False,
                                  ignore_empty=False)[0].double()  # fmt: skip
                m.add("iou", iou.mean(), 1)
            if self.cases is not None:
                self.cases.add(pred[0, 0], dice, iou)

    # ---- accel-eval's per-case outputs -------------------------------------------------

    def keep_cases(self, folder: Path, data: Any) -> None:
        """accel-eval (train/evaluate.py): record each scored case's Dice per class in a table
        and write its predicted label map into `folder` (the data set's format: PNG for
        2-D images, NIfTI for volumes), in the order the loader gives the cases."""
        self.cases = CaseTable(folder, data, self.classes)

    def write_cases(self) -> list[str]:
        return self.cases.write() if self.cases is not None else []


class CaseTable:
    """The per-case rows and predicted label maps of an accel-eval pass."""

    def __init__(self, folder: Path, data: Any, classes: list[str]):
        if folder.exists() and any(folder.iterdir()):
            raise UserError(
                f"{folder}: accel-eval writes the per-case predictions there, and it already "
                "holds files, which are never replaced. Give another `out_path=` (the folder "
                "is named after it) or move that folder away."
            )
        self.folder, self.data, self.classes = folder, data, classes
        self.rows: list[dict] = []

    def add(self, pred: torch.Tensor, dice: torch.Tensor, iou: torch.Tensor | None) -> None:
        i = len(self.rows)
        name = self.data.case_name(i) if hasattr(self.data, "case_name") else str(i)
        row: dict = {"case": name, "dice": float(dice.mean())}
        row.update({f"dice/{c}": float(v) for c, v in zip(self.classes[1:], dice, strict=True)})
        if iou is not None:
            row["iou"] = float(iou.mean())
        writer = getattr(self.data, "write_prediction", None)
        if writer is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = writer(i, pred.to(torch.uint8).cpu().numpy(), self.folder)
            row["prediction"] = path.name
        self.rows.append(row)

    def write(self) -> list[str]:
        self.folder.mkdir(parents=True, exist_ok=True)
        table = self.folder / "cases.csv"
        with table.open("w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=list(self.rows[0]) if self.rows else ["case"])
            out.writeheader()
            out.writerows(self.rows)
        (self.folder / "cases.json").write_text(json.dumps(self.rows, indent=1) + "\n")
        return [str(table), str(self.folder / "cases.json")]
