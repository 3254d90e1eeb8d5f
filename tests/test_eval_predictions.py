"""accel-eval on a classifier (issue 60 B.12) writes, beside its result JSON and named after it,
each item's prediction (a CSV: index, source path, true and predicted class, probability), the
accuracy of each class in the JSON (`per_class_acc`) and a confusion matrix picture: on an
image folder (one row per image, its path in its class's folder) and on a video folder (one row
per video: its clips' averaged prediction)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from helpers import check_ok
from test_image_folder import CLASSES, write_image_folder

# torchvision 0.29 deprecates torchvision.io's decoders (for TorchCodec) and warns on every call.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")

COMMON = ["loader.num_workers=0", "trainer.progress=none", "logger=none", "+debug=fast_dev_run",
          "checkpoint.save_last=true"]  # fmt: skip


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def check_rows(table: list[dict[str, str]], names: list[str]) -> None:
    """Each row: its item's path in its true class's folder, the names matching the indices,
    a probability in (0, 1]."""
    assert [int(r["index"]) for r in table] == list(range(len(table)))
    for r in table:
        assert Path(r["path"]).parent.name == r["class"] == names[int(r["label"])], r
        assert r["predicted_class"] == names[int(r["predicted"])], r
        assert 0 < float(r["probability"]) <= 1, r


def test_an_image_folder_run_writes_predictions_per_class_accuracy_and_a_matrix(run_cli, tmp_path):
    root = write_image_folder(tmp_path / "photos", 4, 3)  # train/ 12, val/ 9: val is scored
    run = tmp_path / "run"
    check_ok(run_cli(["dataset=image_folder", f"dataset.root={root}", "dataset.image_size=16",
                      "loader.batch_size=4", *COMMON, f"hydra.run.dir={run}"]))  # fmt: skip
    ckpt = run / "checkpoints" / "last.pt"
    proc = run_cli([f"ckpt_path={ckpt}", "batch_size=4"], prog="accel-eval")
    check_ok(proc)
    result = json.loads((run / "eval_last_val.json").read_text())
    table = rows(run / "eval_last_val_predictions.csv")
    assert len(table) == result["num_samples"] == 9
    check_rows(table, list(CLASSES))
    assert list(result["per_class_acc"]) == list(CLASSES)
    hits = {c: [r["predicted"] == r["label"] for r in table if r["class"] == c] for c in CLASSES}
    for c in CLASSES:  # the JSON's per-class accuracy is the CSV's, and their mean the total
        assert result["per_class_acc"][c] == pytest.approx(sum(hits[c]) / len(hits[c]))
    total = sum(sum(h) for h in hits.values()) / len(table)
    assert result["val/acc"] == pytest.approx(total)
    png = run / "eval_last_val_confusion_matrix.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "confusion matrix ->" in proc.stdout + proc.stderr
    # out_path: the CSV and picture follow the JSON's name, a file of the user's is untouched.
    mine = tmp_path / "scores" / "mine.csv"
    mine.parent.mkdir()
    mine.write_text("the user's\n")
    check_ok(run_cli([f"ckpt_path={ckpt}", f"out_path={tmp_path / 'scores' / 'a.json'}"],
                     prog="accel-eval"))  # fmt: skip
    made = sorted(p.name for p in mine.parent.iterdir())
    assert made == ["a.json", "a_confusion_matrix.png", "a_predictions.csv", "mine.csv"]
    assert mine.read_text() == "the user's\n"
    # A file of the user's with a name the predictions take: refused, nothing written.
    (tmp_path / "scores" / "b_predictions.csv").write_text("the user's\n")
    proc = run_cli([f"ckpt_path={ckpt}", f"out_path={tmp_path / 'scores' / 'b.json'}"],
                   prog="accel-eval")  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "b_predictions.csv exists and is not one accel-eval wrote" in proc.stderr
    assert not (tmp_path / "scores" / "b.json").exists()
    # accel-eval's own files there are replaced by a later accel-eval (no overwrite needed).
    check_ok(run_cli([f"ckpt_path={ckpt}", f"out_path={tmp_path / 'scores' / 'a.json'}"],
                     prog="accel-eval"))  # fmt: skip


def test_a_video_folder_run_writes_one_row_per_video(run_cli, tmp_path):
    pytest.importorskip("av")
    pytest.importorskip("torchcodec")
    from test_video import DIRECTIONS, write_tree

    root = write_tree(tmp_path / "videos", {"train": 2, "test": 2})
    run = tmp_path / "run"
    check_ok(run_cli(["dataset=video_folder", f"dataset.root={root}", "dataset.test_split=test",
                      "dataset.frames=4", "dataset.image_size=32", "dataset.resize_size=32",
                      "dataset.eval_clips=2", "dataset.val_fraction=0.5",
                      f"dataset.metadata_cache={tmp_path / 'metadata-cache'}",
                      "model=video_cnn", "loader.batch_size=4", *COMMON,
                      f"hydra.run.dir={run}"]))  # fmt: skip
    out = tmp_path / "eval.json"
    check_ok(run_cli([f"ckpt_path={run / 'checkpoints' / 'last.pt'}", f"out_path={out}"],
                     prog="accel-eval"))  # fmt: skip
    result = json.loads(out.read_text())
    table = rows(tmp_path / "eval_predictions.csv")
    # 8 test videos scored as 2 clips each: one row per video, not per clip
    assert len(table) == result["num_samples"] == 8
    names = sorted(DIRECTIONS)
    check_rows(table, names)
    assert list(result["per_class_acc"]) == names
    assert (tmp_path / "eval_confusion_matrix.png").is_file()


def test_the_confusion_matrix_is_drawn_for_30_classes_at_most(tmp_path, caplog):
    """Above 30 classes the picture is skipped in one line (per_class_acc still has them)."""
    import torch

    from accel_train.tasks.predictions import Predictions
    from accel_train.train.eval_predictions import confusion, draw_confusion

    for n, drawn in ((30, True), (31, False)):
        kept = Predictions()
        kept.add(torch.eye(n), torch.arange(n).roll(1))  # each item predicted as the next class
        matrix = confusion(kept, n)
        assert matrix.sum() == n and matrix.trace() == 0
        path = tmp_path / f"{n}.png"
        with caplog.at_level("INFO", logger="accel_train"):
            assert draw_confusion(matrix, [f"c{i}" for i in range(n)], path, "t") is drawn
        assert path.is_file() is drawn
    assert "31.png skipped: 31 classes (drawn for 30 or fewer" in caplog.text
