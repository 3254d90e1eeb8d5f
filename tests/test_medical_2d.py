"""2-D segmentation (issue 63) through the real CLI: `dataset=mask_folder` (images/ and masks/
per split), `task=segmentation` on it (val/dice, val/dice/<class>, val/iou), `model=smp` and the
`+experiment=seg2d_unet` recipe, on a shapes-and-masks set generated here with PIL.

The data: 48x48 RGB images of noise with a bright disc (class 1) and a dark square (class 2) at
random places and sizes; the mask holds the class of each pixel (0 the background).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import check_ok, read_jsonl

pytest.importorskip("monai")
Image = pytest.importorskip("PIL.Image")

SIDE = 48


def shapes_pair(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 RGB image, uint8 label map) of one generated case."""
    yy, xx = np.mgrid[:SIDE, :SIDE]
    mask = np.zeros((SIDE, SIDE), np.uint8)
    cy, cx, r = *rng.uniform(12, SIDE - 12, 2), rng.uniform(5, 10)
    mask[(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = 1
    top, left, side = *rng.integers(2, SIDE - 16, 2), rng.integers(8, 14)
    mask[top : top + side, left : left + side] = 2
    image = rng.normal(128, 25, (SIDE, SIDE, 3))
    image[mask == 1] += (90, 60, 20)
    image[mask == 2] -= (80, 40, 70)
    return np.clip(image, 0, 255).astype(np.uint8), mask


def write_masks(root: Path, split: str, n: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    (root / split / "images").mkdir(parents=True)
    (root / split / "masks").mkdir(parents=True)
    for i in range(n):
        image, mask = shapes_pair(rng)
        Image.fromarray(image).save(root / split / "images" / f"case_{i:03d}.png")
        Image.fromarray(mask).save(root / split / "masks" / f"case_{i:03d}.png")
    return root


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("masks") / "shapes"
    write_masks(root, "train", 64, seed=0)
    return write_masks(root, "val", 12, seed=1)


COMMON = ("logger=none", "trainer.progress=none", "trainer.log_every_n_steps=1")


def test_the_seg2d_recipe_reaches_mean_iou_08(shapes, run_cli, tmp_path):
    run = tmp_path / "run"
    proc = run_cli([
        "+experiment=seg2d_unet", f"dataset.root={shapes}",
        "dataset.crop_size=32",  # (the recipe's 64 px crops need larger images than these)
        "trainer.max_epochs=8", *COMMON, f"hydra.run.dir={run}",
    ])  # fmt: skip
    check_ok(proc)
    done = json.loads((run / "summary.json").read_text())
    assert done["final_val_iou"] >= 0.8, done
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "val/iou" in r]
    assert {"val/dice/1", "val/dice/2"} <= set(rows[-1]), rows[-1]
    assert done["final_val_dice"] >= done["final_val_iou"]  # Dice >= IoU on every case
    text = proc.stdout + proc.stderr
    assert "dataset=mask_folder: 64 train / 12 val image-mask pairs, 3 classes" in text
    # accel-eval: the per-case table and the predicted label maps as PNGs.
    out = tmp_path / "eval.json"
    ckpt = run / "checkpoints" / "last.pt"
    check_ok(run_cli([f"ckpt_path={ckpt}", f"out_path={out}"], prog="accel-eval"))
    result = json.loads(out.read_text())
    assert result["val/iou"] == pytest.approx(done["final_val_iou"])
    rows = json.loads((tmp_path / "eval_cases" / "cases.json").read_text())
    assert [r["case"] for r in rows] == [f"case_{i:03d}" for i in range(12)]
    assert sum(r["iou"] for r in rows) / 12 == pytest.approx(result["val/iou"])
    pred = np.asarray(Image.open(tmp_path / "eval_cases" / "case_000.png"))
    truth = np.asarray(Image.open(shapes / "val" / "masks" / "case_000.png"))
    assert pred.shape == truth.shape and (pred == truth).mean() > 0.9


def test_smp_unet_trains_on_a_held_out_mask_folder(shapes, run_cli, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(shapes / "train", root / "train")  # no val/: a seeded hold-out
    run = tmp_path / "run"
    proc = run_cli([
        "task=segmentation", "dataset=mask_folder", f"dataset.root={root}",
        "dataset.val_fraction=0.1", "dataset.crop_size=32", "dataset.classes=[bg,disc,square]",
        "model=smp", "model.name=Unet", "model.encoder=resnet18", "+model.encoder_depth=3",
        "+model.decoder_channels=[32,16,8]", "loader.batch_size=4", "trainer.max_steps=1",
        "trainer.limit_val_batches=1", *COMMON, f"hydra.run.dir={run}",
    ])  # fmt: skip
    check_ok(proc)
    assert "58 train / 6 val image-mask pairs (held out), 3 classes (bg, disc, square)" in (
        proc.stdout + proc.stderr
    )
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "val/iou" in r]
    assert rows and 0 <= rows[-1]["val/dice/square"] <= 1 and 0 <= rows[-1]["val/iou"] <= 1


def _refused(run_cli, root: Path, tmp_path: Path, *extra: str) -> str:
    proc = run_cli([
        "task=segmentation", "dataset=mask_folder", f"dataset.root={root}", "model=monai",
        "model.name=UNet", "model.args={channels: [8, 16], strides: [2]}", "trainer.max_steps=1",
        *COMMON, f"hydra.run.dir={tmp_path / 'run'}", *extra,
    ])  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    return " ".join(proc.stderr.split())


def _small(shapes: Path, tmp_path: Path) -> Path:
    root = tmp_path / "data"
    for split in ("train", "val"):
        for sub in ("images", "masks"):
            (root / split / sub).mkdir(parents=True)
            for p in sorted((shapes / split / sub).iterdir())[:3]:
                shutil.copy(p, root / split / sub / p.name)
    return root


def test_an_image_without_a_mask_is_refused_by_name(shapes, run_cli, tmp_path):
    root = _small(shapes, tmp_path)
    (root / "train" / "masks" / "case_001.png").unlink()
    err = _refused(run_cli, root, tmp_path)
    assert "case_001.png: this image has no mask" in err


def test_a_mask_of_another_size_is_refused_by_name(shapes, run_cli, tmp_path):
    root = _small(shapes, tmp_path)
    path = root / "val" / "masks" / "case_002.png"
    Image.open(path).crop((0, 0, 40, SIDE)).save(path)
    err = _refused(run_cli, root, tmp_path)
    assert "case_002.png: the mask is 40x48 (WxH)" in err


def test_label_values_beyond_the_classes_are_refused_by_name(shapes, run_cli, tmp_path):
    root = _small(shapes, tmp_path)
    err = _refused(run_cli, root, tmp_path, "dataset.num_classes=2")
    assert "case_000.png: label value(s) [2] are not classes" in err
