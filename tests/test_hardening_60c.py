"""Issue 60 (Hardening 5), third part, through the real CLI: the video recipe on a small folder
(a hold-out of one video a class, "(N batches)" after a cut evaluation), the video defaults, the
real validation loss of a multi-clip evaluation, GRPO's console and curves, the progress bar's
first frame, and Ray's and LitData's warnings."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import check_ok

# The moving squares of tests/test_video.py: 32 x 32 px, 16 frames at 15 fps.
SMALL_CLIPS = ["dataset.image_size=32", "dataset.resize_size=32", "dataset.eval_clips=2",
               "loader.batch_size=4", "model=video_cnn"]  # fmt: skip
QUIET = ["trainer.progress=none", "logger=none"]


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    """3 training videos a class (a 1 % hold-out of them is none) and 2 test videos a class."""
    pytest.importorskip("av")
    pytest.importorskip("torchcodec")
    from test_video import write_tree

    return write_tree(tmp_path_factory.mktemp("videos") / "data", {"train": 3, "test": 2})


def cache(root: Path) -> str:
    return f"dataset.metadata_cache={root.parent / 'metadata-cache'}"  # not the user's ~/.cache


def test_the_video_recipe_holds_out_a_video_a_class_and_says_a_cut_evaluation(
    videos, run_cli, tmp_path
):
    """+experiment=video_r2plus1d (1 % held out) on 12 training videos validates on one video of
    each of the 4 classes; +debug=fast_dev_run's one-batch validation and test say "(1 batch)"
    in their log lines and in the done: line."""
    args = ["+experiment=video_r2plus1d", f"dataset.root={videos}", "dataset.test_split=test",
            cache(videos), *SMALL_CLIPS, "loader.batch_size=2", "+debug=fast_dev_run",
            "trainer.progress=plain", "logger=none",
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = run_cli(args)
    check_ok(proc)
    text = proc.stdout + proc.stderr
    assert "split is empty" not in text
    val_line = next(x for x in text.splitlines() if "val/acc=" in x)
    test_line = next(x for x in text.splitlines() if "test/acc=" in x and "test (" in x)
    done = next(x for x in text.splitlines() if "done:" in x)
    assert val_line.rstrip().endswith("(1 batch)"), val_line
    assert test_line.rstrip().endswith("(1 batch)"), test_line
    assert "(1 batch)" in done, done
    # One video of each class held out (1 % of 3 rounds to none): 4 validation, 8 training.
    assert "data video_folder: 8 train / 4 val / 8 test" in text


def test_a_hold_out_no_class_can_give_is_refused_with_the_numbers(run_cli, tmp_path):
    pytest.importorskip("av")
    pytest.importorskip("torchcodec")
    from test_video import write_tree

    root = write_tree(tmp_path / "data", {"train": 1})
    args = [
        "dataset=video_folder",
        f"dataset.root={root}",
        "dataset.val_split=null",
        "dataset.frames=8",
        "dataset.frame_stride=1",
        cache(root),
        *SMALL_CLIPS,
        *QUIET,
    ]
    proc = run_cli(args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = next(x for x in proc.stderr.splitlines() if "error:" in x)
    assert "dataset.val_fraction=0.1 holds out no video" in line, line
    assert "4 training video(s) in 4 class(es)" in line and "dataset.val_split" in line


def _two_second_clips(root: Path, per_class: int, frames: int = 30) -> Path:
    """Videos of `frames` frames at 15 fps (30: 2 s) in train/ and test/, two classes."""
    from test_video import write_video

    n = 0
    for split in ("train", "test"):
        for d in ("left", "right"):
            (root / split / d).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                write_video(root / split / d / f"{i}.mp4", d, seed=n, frames=frames)
                n += 1
    return root


def test_the_documented_first_video_command_takes_two_second_clips(run_cli, tmp_path):
    """docs/video.md's first command, at the dataset's defaults (16 frames at 15 fps, the
    reference's), trains on 2-s 15-fps clips (the old stride 2 needed 31 frames)."""
    pytest.importorskip("av")
    pytest.importorskip("torchcodec")
    root = _two_second_clips(tmp_path / "data", 3)
    args = ["model=video_cnn", "dataset=video_folder", f"dataset.root={root}", cache(root),
            "+debug=fast_dev_run", "loader.batch_size=2", "dataset.eval_clips=1", *QUIET,
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    check_ok(run_cli(args))
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "fps: 15" in saved and "frame_stride: null" in saved and "crop_scale: null" in saved


def test_the_training_crop_is_the_video_references_resize_and_random_crop():
    """Resize((128, 171)) + RandomCrop(112), as the box of the source frame it shows: 112/128
    of the height and 112/171 of the width, anywhere inside (a 240x320 frame)."""
    import random

    from accel_train.data.crops import ResizedRandomCrop

    crop = ResizedRandomCrop(112, (128, 171), hflip=True)
    boxes = [crop.box(240, 320, random.Random(k)) for k in range(50)]
    assert {(h, w) for _, _, h, w in boxes} == {(round(112 * 240 / 128), round(112 * 320 / 171))}
    assert all(0 <= t <= 240 - h and 0 <= x <= 320 - w for t, x, h, w in boxes)
    assert len({(t, x) for t, x, _, _ in boxes}) > 10  # random positions


def test_sharding_videos_skips_the_clip_length_check(run_cli, tmp_path):
    """accel-data shard stores whole videos: 8-frame videos, shorter than the default clip,
    are sharded; training from them at that clip is refused by dataset=streaming_video."""
    pytest.importorskip("av")
    pytest.importorskip("torchcodec")
    pytest.importorskip("litdata")
    root = _two_second_clips(tmp_path / "data", 2, frames=8)
    out = tmp_path / "shards"
    args = ["shard", "dataset=video_folder", f"dataset.root={root}", cache(root),
            "dataset.val_fraction=0.5", f"out={out}"]  # fmt: skip
    check_ok(run_cli(args, prog="accel-data"))
    assert (out / "accel_train.index.json").is_file()
    proc = run_cli(["model=video_cnn", "dataset=streaming_video", f"dataset.remote={out}", *QUIET])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "dataset.pad_short" in proc.stderr


def test_a_multi_clip_loss_is_the_real_one_and_unsettled_batchnorm_is_said(
    videos, run_cli, tmp_path
):
    """r3d_18 evaluated after 2 tiny batches: its BatchNorm statistics are mostly the initial
    ones, so evaluation-mode outputs are wildly confident. The validation loss is the real
    cross-entropy of the clips' averaged prediction (the old clamp of the averaged probabilities
    at 1e-12 capped it at 27.63 a video), and the log says once why it is so large."""
    import math

    from helpers import read_jsonl

    run = tmp_path / "run"
    args = ["model=torchvision", "model.name=r3d_18", "dataset=video_folder",
            f"dataset.root={videos}", cache(videos), "dataset.frames=4", "dataset.image_size=16",
            "dataset.resize_size=16", "dataset.eval_clips=2", "dataset.val_fraction=0.34",
            "loader.batch_size=4", "trainer.max_steps=2", "optimizer.lr=0.1",
            "trainer.limit_test_batches=1", "checkpoint.save_top_k=0", "checkpoint.save_last=false",
            "trainer.plot_curves=false", *QUIET, f"hydra.run.dir={run}"]  # fmt: skip
    proc = run_cli(args)
    check_ok(proc)
    text = proc.stdout + proc.stderr
    assert text.count("BatchNorm layers normalise by running statistics of only 2") == 1, text
    loss = next(r["val/loss"] for r in read_jsonl(run / "metrics.jsonl") if "val/loss" in r)
    assert math.isfinite(loss) and loss > 28, loss
