"""Medical segmentation (issue 63) through the real CLI: `task=segmentation dataset=volume_folder
model=monai`, on volumes generated here with nibabel.

The data: a Decathlon-layout folder of 8 CT-like cases, 32^3 voxels at spacings drawn from
1.0-2.0 mm per axis, air (-1000 HU) around a box of soft tissue (about -50 HU) holding one
ellipsoid "organ" (about 120 HU, random centre and radii). A tiny 3-level UNet trains on 16^3
patches and is validated on the whole held-out volumes by sliding window.

- It learns: val/dice >= 0.8 (and val/dice/organ, named from dataset.json);
- the disk cache is written by the first run, reused by the next (nothing written, the same
  patches: an exact mid-epoch resume ends with the uninterrupted run's weights), and rebuilt
  when a deterministic setting (the spacing) changes;
- an nnU-Net v2 folder (channel files, labels name -> index) trains too;
- the header check refuses an image without a label, label values outside dataset.json's
  classes and a truncated .nii.gz, naming the file, before anything is written.
"""

from __future__ import annotations

import gzip
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_weights, check_ok, losses, read_jsonl, summary

nib = pytest.importorskip("nibabel")
pytest.importorskip("monai")

SIDE, CASES = 32, 8
EPOCHS = 4
STEPS_PER_EPOCH = 3  # 6 training cases (2 held out) in batches of 2 volumes


def organ_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image in HU, label, affine) of one generated case."""
    spacing = rng.uniform(1.0, 2.0, 3)
    grid = np.stack(np.meshgrid(*[np.arange(SIDE)] * 3, indexing="ij"), -1).astype(float)
    centre = rng.uniform(SIDE * 0.35, SIDE * 0.65, 3)
    radii = rng.uniform(SIDE * 0.15, SIDE * 0.3, 3)
    inside = (((grid - centre) / radii) ** 2).sum(-1) <= 1
    image = rng.normal(-1000, 20, (SIDE,) * 3)  # air
    m = SIDE // 8
    image[m:-m, m:-m, m:-m] = rng.normal(-50, 40, (SIDE - 2 * m,) * 3)  # the body
    image[inside] = rng.normal(120, 30, int(inside.sum()))
    return image.astype(np.float32), inside.astype(np.uint8), np.diag([*spacing, 1.0])


def write_decathlon(root: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    training = []
    for i in range(CASES):
        image, label, affine = organ_case(rng)
        name = f"organ_{i:03d}.nii.gz"
        nib.save(nib.Nifti1Image(image, affine), root / "imagesTr" / name)
        nib.save(nib.Nifti1Image(label, affine), root / "labelsTr" / name)
        training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
    meta = {"name": "organ", "modality": {"0": "CT"}, "numTraining": CASES,
            "labels": {"0": "background", "1": "organ"}, "training": training}  # fmt: skip
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def write_nnunet(root: Path, decathlon: Path) -> Path:
    """The same cases in nnU-Net v2's layout: <case>_0000.nii.gz, labels name -> index."""
    (root / "imagesTr").mkdir(parents=True)
    shutil.copytree(decathlon / "labelsTr", root / "labelsTr")
    for path in sorted((decathlon / "imagesTr").glob("*.nii.gz")):
        shutil.copy(path, root / "imagesTr" / path.name.replace(".nii.gz", "_0000.nii.gz"))
    meta = {"channel_names": {"0": "CT"}, "labels": {"background": 0, "organ": 1},
            "numTraining": CASES, "file_ending": ".nii.gz"}  # fmt: skip
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


@pytest.fixture(scope="module")
def volumes(tmp_path_factory) -> Path:
    return write_decathlon(tmp_path_factory.mktemp("medical") / "Task01_Organ")


def args(root: Path, run_dir: Path, cache: Path, *extra: str) -> list[str]:
    return [
        "task=segmentation",
        "dataset=volume_folder",
        f"dataset.root={root}",
        "dataset.cache=disk",
        f"dataset.cache_dir={cache}",
        "dataset.patch_size=[16,16,16]",
        "dataset.samples_per_volume=2",
        "model=monai",
        "model.name=UNet",
        "model.args={channels: [8, 16, 32], strides: [2, 2], num_res_units: 0}",
        "optimizer=adamw",
        "optimizer.lr=0.01",
        "loader.batch_size=2",
        f"trainer.max_epochs={EPOCHS}",
        "trainer.deterministic=true",
        "trainer.log_every_n_steps=1",
        "trainer.progress=none",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(volumes, tmp_path_factory, run_cli_in) -> dict:
    """The reference run (it writes the disk cache), then, two at a time: the same run stopped
    mid-epoch and resumed (reading the cache) and a run with another spacing (rebuilding it)."""
    cwd = tmp_path_factory.mktemp("medical-runs")
    cache = cwd / "cache"
    out: dict = {"cache": cache}
    for name in ("full", "resumed", "spacing"):
        out[name] = cwd / name
    out["full_proc"] = run_cli_in(args(volumes, out["full"], cache), cwd)
    check_ok(out["full_proc"])
    stop = STEPS_PER_EPOCH + 1  # in the second epoch

    def resumed():
        common = args(volumes, out["resumed"], cache, "resume=auto")
        out["stopped_proc"] = run_cli_in([*common, f"trainer.max_steps={stop}"], cwd)
        check_ok(out["stopped_proc"])
        out["stopped_losses"] = losses(out["resumed"])
        check_ok(run_cli_in(common, cwd))

    def spacing():
        extra = ("dataset.spacing=[1.5,1.5,1.5]", "trainer.max_steps=1")
        out["spacing_proc"] = run_cli_in(args(volumes, out["spacing"], cache, *extra), cwd)
        check_ok(out["spacing_proc"])

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(resumed), pool.submit(spacing)]:
            f.result()
    return out


def cache_line(proc) -> str:
    text = proc.stdout + proc.stderr
    return next(line for line in text.splitlines() if "dataset=volume_folder:" in line)


def test_a_tiny_unet_learns_the_organ_validated_by_sliding_window(runs):
    done = summary(runs["full"])
    assert done["best_val_dice"] >= 0.8, done
    assert done["final_val_dice/organ"] >= 0.8, done  # the class named from dataset.json
    text = runs["full_proc"].stdout + runs["full_proc"].stderr
    # The start-up line says what a step trains on: volumes x patches.
    assert "loader.batch_size=2 volumes x dataset.samples_per_volume=2 patches" in text


def test_accel_eval_scores_the_held_out_volumes_as_validation_did(runs, run_cli, tmp_path):
    out = tmp_path / "eval.json"
    ckpt = runs["full"] / "checkpoints" / "best.pt"
    check_ok(run_cli([f"ckpt_path={ckpt}", f"out_path={out}"], prog="accel-eval"))
    result = json.loads(out.read_text())
    assert result["split"] == "val"  # (no test split: imagesTs/ has no labels)
    assert result["val/dice/organ"] == pytest.approx(summary(runs["full"])["best_val_dice"])
    # The per-case table (case, Dice per class) and each case's predicted label map (NIfTI on
    # the preprocessed grid, with its affine), in a folder named after out_path.
    rows = json.loads((tmp_path / "eval_cases" / "cases.json").read_text())
    assert len(rows) == 2 and all(r["case"].startswith("organ_") for r in rows)
    mean = sum(r["dice/organ"] for r in rows) / len(rows)
    assert mean == pytest.approx(result["val/dice/organ"])
    header = (tmp_path / "eval_cases" / "cases.csv").read_text().splitlines()[0]
    assert header == "case,dice,dice/organ,prediction"
    pred = nib.load(tmp_path / "eval_cases" / rows[0]["prediction"])
    assert set(np.unique(np.asarray(pred.dataobj)).tolist()) <= {0, 1}
    assert result["cases"] == [
        str(tmp_path / "eval_cases" / n) for n in ("cases.csv", "cases.json")
    ]


def test_the_disk_cache_is_reused_and_rebuilt_when_a_setting_changes(runs):
    assert "(0 reused, 8 written" in cache_line(runs["full_proc"])
    assert "(8 reused, 0 written" in cache_line(runs["stopped_proc"])
    assert "(0 reused, 8 written" in cache_line(runs["spacing_proc"])
    entries = [p for p in runs["cache"].iterdir() if p.is_dir()]
    assert len(entries) == 16  # two settings x 8 cases, each arrays plus JSON: no pickle
    assert {p.name for p in entries[0].iterdir()} == {"image.npy", "label.npy", "meta.json"}
    assert not [p for p in runs["cache"].iterdir() if ".tmp-" in p.name]


def test_a_mid_epoch_resume_draws_the_same_patches(runs):
    reference = losses(runs["full"])
    stopped, resumed = runs["stopped_losses"], losses(runs["resumed"])
    assert sorted(stopped) == list(range(1, STEPS_PER_EPOCH + 2))
    assert all(stopped[s] == reference[s] for s in stopped)
    assert all(resumed[s] == reference[s] for s in resumed)
    assert_same_weights(
        runs["resumed"] / "checkpoints" / "last.pt", runs["full"] / "checkpoints" / "last.pt"
    )


def test_an_nnunet_folder_trains(volumes, run_cli, tmp_path):
    root = write_nnunet(tmp_path / "Dataset001_Organ", volumes)
    proc = run_cli(args(root, tmp_path / "run", tmp_path / "cache", "trainer.max_steps=2"))
    check_ok(proc)
    assert "nnunet layout, 8 cases (6 train / 2 val)" in cache_line(proc)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert any(0 <= r.get("val/dice/organ", -1) <= 1 for r in rows), rows


def _refused(run_cli, root: Path, tmp_path: Path) -> str:
    cache = tmp_path / "cache"
    proc = run_cli(args(root, tmp_path / "run", cache, "trainer.max_steps=1"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not cache.exists()  # the check runs before anything is written
    return proc.stderr


def _copy(volumes: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(volumes, tmp_path / "data"))


def test_another_task_is_refused_naming_the_one_it_feeds(volumes, run_cli, tmp_path):
    argv = [
        a for a in args(volumes, tmp_path / "run", tmp_path / "cache") if a != "task=segmentation"
    ]
    proc = run_cli([*argv, "trainer.max_steps=1"])  # the default task: classification
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "dataset=volume_folder feeds only task=segmentation" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_image_without_a_label_is_refused_by_name(volumes, run_cli, tmp_path):
    root = _copy(volumes, tmp_path)
    (root / "labelsTr" / "organ_003.nii.gz").unlink()
    err = _refused(run_cli, root, tmp_path)
    assert "organ_003.nii.gz: this image has no label" in err


def test_label_values_outside_the_classes_are_refused_by_name(volumes, run_cli, tmp_path):
    root = _copy(volumes, tmp_path)
    path = root / "labelsTr" / "organ_005.nii.gz"
    img = nib.load(path)
    label = np.asarray(img.dataobj).copy()
    label[0, 0, 0] = 3
    nib.save(nib.Nifti1Image(label, img.affine), path)
    err = _refused(run_cli, root, tmp_path)
    assert "organ_005.nii.gz: label value(s) [3] are not classes" in err


def test_a_truncated_file_is_refused_by_name(volumes, run_cli, tmp_path):
    root = _copy(volumes, tmp_path)
    path = root / "imagesTr" / "organ_006.nii.gz"
    data = path.read_bytes()
    assert gzip.decompress(data)  # a whole file before
    path.write_bytes(data[: len(data) // 2])
    err = _refused(run_cli, root, tmp_path)
    assert "organ_006.nii.gz: the file cannot be read as NIfTI" in err
