"""What a careless user hits with their own photos (issue 47), through the real CLI: a JPEG cut
short, the ImageNet layout (train/ and val/), .webp and stray files, a ViT on a progressive
schedule, a model that cannot take the schedule's sizes, a misspelled RandAugment policy.

Four runs of ~5 s on 2 cores; one of them trains (two epochs of one batch, timm's tiny ViT)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import check_ok, read_jsonl
from test_image_folder import write_image_folder

pytestmark = [
    pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The given NumPy array is not writable"),
]

SCHEDULE = (
    "trainer.progressive_resize={start_size:16,end_size:32,start_epoch:0,end_epoch:1,step:16}"
)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """3 classes x 6 train/ and 2 val/ JPEGs (no test/); one train/ image a .webp, one more a
    .bmp; two stray files torchvision's ImageFolder would not read either."""
    from PIL import Image

    root = write_image_folder(tmp_path_factory.mktemp("careless") / "photos", 6, 2)
    jpg = root / "train" / "ant" / "000.jpg"
    with Image.open(jpg) as im:
        im.convert("RGB").save(jpg.with_suffix(".webp"), "WEBP")
        im.convert("RGB").save(root / "train" / "bee" / "900.bmp", "BMP")
    jpg.unlink()
    (root / "train" / "cat" / "notes.txt").write_text("not an image")
    (root / "train" / "cat" / "IMG_0001.heic").write_bytes(b"\0" * 64)
    return root


def args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "dataset=image_folder", f"dataset.root={root}", "dataset.image_size=32",
        "loader.batch_size=6", "loader.num_workers=0", "trainer.progress=none", "logger=none",
        f"hydra.run.dir={run_dir}", *extra,
    ]  # fmt: skip


def refused(proc, *texts: str) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for text in texts:
        assert text in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def test_the_imagenet_layout_webp_and_a_vit_on_a_progressive_schedule(photos, run_cli, tmp_path):
    """train/ + val/: all of train/ trains, val/ validates (F.28); the .webp and .bmp are read,
    the two stray files named in one line (A.4); timm's ViT gets dynamic_img_size and trains at
    16 then 32 px (A.2)."""
    run_dir = tmp_path / "run"
    model = ["model=timm", "model.name=test_vit", SCHEDULE, "trainer.max_epochs=2"]
    limits = ["trainer.limit_train_batches=1", "trainer.limit_val_batches=1"]
    proc = run_cli(args(photos, run_dir, *model, *limits))
    check_ok(proc)
    log = proc.stdout + proc.stderr
    assert "training on all 19 images of train/, validating on val/ (6), no test split" in log
    assert "data image_folder: 19 train / 6 val / no test" in log
    skipped = next(ln for ln in log.splitlines() if "skipped 2 file(s)" in ln)
    assert "cat/IMG_0001.heic" in skipped and "cat/notes.txt" in skipped
    assert "model.dynamic_img_size=true" in log
    assert "epoch 0 trains at 16 px" in log and "epoch 1 trains at 32 px" in log
    assert sum("val/loss" in m for m in read_jsonl(run_dir / "metrics.jsonl")) == 2
    # accel-eval with no split scores val/ when the folder has no test/, as timm's validate.py.
    ckpt = run_dir / "checkpoints" / "last.pt"
    scored = run_cli([f"ckpt_path={ckpt}", "device=cpu"], prog="accel-eval")
    check_ok(scored)
    assert "no test split: scoring its validation split" in scored.stdout + scored.stderr
    assert "val/acc=" in scored.stdout + scored.stderr
    asked = run_cli([f"ckpt_path={ckpt}", "device=cpu", "split=test"], prog="accel-eval")
    refused(asked, "split=test asked for a split", "`split=val`")


def test_a_model_that_cannot_take_a_size_of_the_schedule_is_refused_before_training(
    photos, run_cli, tmp_path
):
    """The ViT kept at one input size (dynamic_img_size=false): the probe tries 16 and 32 px
    before the first step and names the size it fails at (A.2)."""
    run_dir = tmp_path / "run"
    model = ["model=timm", "model.name=test_vit", "+model.dynamic_img_size=false", SCHEDULE]
    # (built at 16 px, the size of epoch 0: the sample the task checks fits; 32 px does not)
    proc = run_cli(args(photos, run_dir, *model, "trainer.max_epochs=2", "dataset.image_size=16"))
    text = refused(proc, "trainer.progressive_resize trains at", "fails on images of that size")
    assert "+model.dynamic_img_size=true" in text
    assert not (run_dir / "metrics.jsonl").exists()


def test_truncated_jpegs_are_all_named_before_anything_is_trained(photos, run_cli, tmp_path):
    """Cut inside their entropy data (their headers read fine): refused by the header check,
    both at once, exit 2, nothing trained (A.1)."""
    root = Path(shutil.copytree(photos, tmp_path / "photos"))
    cut = [root / "train" / "bee" / "001.jpg", root / "val" / "cat" / "000.jpg"]
    for path in cut:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) * 3 // 4])
    run_dir = tmp_path / "run"
    proc = run_cli(args(root, run_dir, "+debug=fast_dev_run"))
    refused(proc, "truncated", "end-of-image marker", *(str(p) for p in cut))
    assert not (run_dir / "metrics.jsonl").exists()


def test_an_unknown_section_of_a_policy_is_refused(photos, run_cli, tmp_path):
    """timm skips a section it does not know: `rand-bogus` ran as plain RandAugment (A.3)."""
    proc = run_cli(args(photos, tmp_path / "run", "dataset.auto_augment=rand-bogus"))
    refused(proc, "dataset.auto_augment='rand-bogus'", "the section 'bogus'", "mstd<number>")


def test_an_architecture_without_dynamic_img_size_is_refused_with_a_schedule(compose_cfg):
    """In the launching process, before config.yaml (the CLI path of the ViT run above, without
    a run): a relative-position ViT has no dynamic_img_size to take the schedule's sizes (A.2)."""
    from accel_train.errors import UserError
    from accel_train.models.timm import prepare_config

    base = ["model=timm", "dataset=image_folder", "dataset.root=x", SCHEDULE]
    cfg = compose_cfg([*base, "model.name=test_vit_relpos"])
    with pytest.raises(UserError, match="test_vit_relpos takes one input size only"):
        prepare_config(cfg)
    cfg = compose_cfg([*base, "model.name=test_vit"])
    prepare_config(cfg)
    assert cfg.model.dynamic_img_size is True
    cfg = compose_cfg(
        ["model=timm", "model.name=test_vit", "dataset=image_folder", "dataset.root=x"]
    )
    prepare_config(cfg)
    assert "dynamic_img_size" not in cfg.model  # no schedule: the model as asked
