"""accel-eval's per-item view of a classifier: each item's prediction (a CSV), the accuracy of
each class (in the result JSON, `per_class_acc`) and a confusion matrix picture, beside the
result JSON and named after it (eval_best.json -> eval_best_predictions.csv,
eval_best_confusion_matrix.png), written by the same rules: accel-eval's own names, replaced by
a later accel-eval, never another file.

The record comes from the task (`Task.keep_predictions()`, tasks/predictions.py): items in the
loader's order, which accel-eval's one-process loader keeps as the split's own (item i of the
CSV is the split's item i; a video's row is its clips' averaged prediction)."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import torch

from accel_train.tasks import Predictions

log = logging.getLogger("accel_train")
# Above this many classes the confusion matrix is not drawn: its cells and names become
# unreadable at any size a picture can have (the per-class accuracy says it in the JSON).
MAX_DRAWN_CLASSES = 30
HEADER = ["index", "path", "label", "class", "predicted", "predicted_class", "probability"]
# Kept in the picture's PNG text: how a later accel-eval knows the picture is its own.
MARK = "accel-eval confusion matrix"


def foreign_file(out: Path) -> Path | None:
    """The CSV or picture beside `out` that exists and is not accel-eval's (None: both are
    free to write): a CSV replaced must start with accel-eval's header, a picture hold MARK."""
    table, picture = prediction_paths(out)
    if table.is_file():
        try:
            with table.open(newline="") as f:
                first = f.readline().strip()
        except (OSError, UnicodeDecodeError):
            first = ""
        if first != ",".join(HEADER):
            return table
    if picture.is_file():
        try:
            ours = MARK.encode() in picture.read_bytes()
        except OSError:
            ours = False
        if not ours:
            return picture
    return None


def prediction_paths(out: Path) -> tuple[Path, Path]:
    """(the CSV, the picture) beside the result JSON `out`, named after it."""
    stem = out.name[: -len(".json")] if out.name.endswith(".json") else out.name
    return out.with_name(f"{stem}_predictions.csv"), out.with_name(f"{stem}_confusion_matrix.png")


def class_names(splits: Any) -> list[str]:
    """The data's class names in label order (Splits.class_names), else the indices."""
    num_classes = splits.num_classes
    names = getattr(splits, "class_names", None)
    if names and len(names) == num_classes:
        return [str(n) for n in names]
    return [str(i) for i in range(num_classes)]


def per_class_accuracy(kept: Predictions, names: list[str]) -> dict[str, float | None]:
    """{class name: top-1 accuracy of its items} (None: the split has none of that class)."""
    labels, predicted, _ = kept.arrays()
    out: dict[str, float | None] = {}
    for c, name in enumerate(names):
        mine = labels == c
        n = int(mine.sum())
        out[name] = float((predicted[mine] == c).sum()) / n if n else None
    return out


def confusion(kept: Predictions, num_classes: int) -> torch.Tensor:
    """(true, predicted) counts, int64 [classes, classes]."""
    labels, predicted, _ = kept.arrays()
    flat = labels * num_classes + predicted
    return torch.bincount(flat, minlength=num_classes * num_classes).view(num_classes, -1)


def write_csv(kept: Predictions, data: Any, names: list[str], path: Path) -> None:
    """One row per item: index, source path (empty where the data set knows none), true
    label and class name, predicted label and class name, the predicted class's probability."""
    labels, predicted, probability = kept.arrays()
    source = getattr(data, "path", None)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for i, (y, p, prob) in enumerate(
            zip(labels.tolist(), predicted.tolist(), probability.tolist(), strict=True)
        ):
            where = source(i) if source is not None else ""
            w.writerow([i, where, y, names[y], p, names[p], f"{prob:.6f}"])


def draw_confusion(matrix: torch.Tensor, names: list[str], path: Path, title: str) -> bool:
    """The matrix as a picture (rows: true class, columns: predicted; each cell its count,
    coloured by the share of its row). False: not drawn (too many classes, no matplotlib)."""
    n = len(names)
    if n > MAX_DRAWN_CLASSES:
        log.info("%s skipped: %d classes (drawn for %d or fewer; per_class_acc in the JSON "
                 "has each class's accuracy)", path.name, n, MAX_DRAWN_CLASSES)  # fmt: skip
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, none opened
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        # matplotlib's object API, not pyplot: no global figure registry.
        from matplotlib.figure import Figure
    except ImportError:
        log.info("%s skipped: matplotlib cannot be imported here (`pip install matplotlib`)",
                 path.name)  # fmt: skip
        return False
    rows = matrix.double()
    share = rows / rows.sum(1, keepdim=True).clamp(min=1)
    side = max(4.0, 0.45 * n + 2)
    fig = Figure(figsize=(side + 1, side))
    ax = fig.subplots()
    image = ax.imshow(share.numpy(), cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(image, ax=ax, label="share of the true class", shrink=0.8)
    for i in range(n):
        for j in range(n):
            ax.text(j, i, str(int(matrix[i, j])), ha="center", va="center", fontsize=8,
                    color="white" if share[i, j] > 0.5 else "black")  # fmt: skip
    ax.set_xticks(range(n), names, rotation=90 if n > 8 else 0)
    ax.set_yticks(range(n), names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Title": f"{MARK}: {title}"})
    return True
