"""Issue 60 (Hardening 5), third part, through the real CLI: the video recipe on a small folder
(a hold-out of one video a class, "(N batches)" after a cut evaluation), the video defaults, the
real validation loss of a multi-clip evaluation, GRPO's console and curves, the progress bar's
first frame, and Ray's and LitData's warnings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
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
    # One video of each class held out (1 % of 3 rounds to none): 4 validation, 8 training
    # videos, each 5 times (dataset.clips_per_video=5, the reference's 5 clips a video).
    assert "data video_folder: 40 train / 4 val / 8 test" in text


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


def test_grpo_console_curves_and_trl_metrics(run_cli, tmp_path):
    """task=grpo: the console's logging line shows a few numbers formatted as other tasks'
    (no `=0.`, no 17-digit advantage), the summary a row per metric, the done: line the share
    of the epoch a step limit cut; curves.png has the reward and length panels; TRL's
    num_tokens (a running total), clip_ratio/low_min, high_max and mean_terminated_length are
    logged."""
    import re

    from helpers import read_jsonl
    from hf_fixtures import write_tiny_llama
    from test_grpo import RUN, _records, _rewards_arg, _write
    from torchvision.io import decode_image

    llama = write_tiny_llama(tmp_path / "llama")
    data = _write(tmp_path / "prompts.jsonl", _records(16))  # 15 train prompts: 8 steps/epoch
    run = tmp_path / "run"
    args = [*RUN[:-1], f"model.path={llama}", f"dataset.path={data}", _rewards_arg(),
            "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.progress=plain",
            "trainer.plot_curves=true", f"hydra.run.dir={run}"]  # fmt: skip
    proc = run_cli(args)
    check_ok(proc)
    text = proc.stdout + proc.stderr
    lines = [x for x in text.splitlines() if "epoch 1/1 step" in x and " loss=" in x]
    assert len(lines) == 2, text[-3000:]
    for line in lines:
        assert "reward=" in line and "reward_std=" in line and "completions/mean_length=" in line
        assert "rewards/exact_match/mean" not in line and len(line) < 320, line
    shown = [x for x in text.splitlines() if "step " in x and ("=" in x)]
    assert not [x for x in shown if re.search(r"=-?\d+\.(\s|$)", x)], "a number ends in '.'"
    assert not [x for x in shown if re.search(r"=-?\d+\.\d{6,}", x)], "an unrounded number"
    assert "done: 2 steps, 0.25 epochs" in text
    assert "final val/reward" in text and "final val/completions/mean_length" in text
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    tokens = [r["train/num_tokens"] for r in rows]
    assert 0 < tokens[0] < tokens[1]
    for name in ("clip_ratio/low_min", "clip_ratio/high_max", "completions/mean_terminated_length"):
        assert all(f"train/{name}" in r for r in rows), name
    val = [r for r in read_jsonl(run / "metrics.jsonl") if "val/reward" in r]
    assert val and all("val/rewards/exact_match/mean" in r for r in val)  # each function's
    picture = decode_image(str(run / "curves.png"))
    assert picture.shape[-1] == 1500  # three panels: reward, length, loss (500 px each)


def _on_a_terminal(args: list[str], cwd: Path) -> str:
    """accel-train run on a pseudo-terminal (the rich bar draws only on one): its output."""
    import os
    import pty
    import select
    import subprocess
    import sys

    from helpers import base_env

    master, slave = pty.openpty()
    exe = Path(sys.executable).parent / "accel-train"
    env = {**base_env(), "COLUMNS": "160", "ACCEL_TRAIN_DATA_DIR": str(cwd / "no-data")}
    proc = subprocess.Popen([str(exe), *args], stdout=slave, stderr=slave, cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL)  # fmt: skip
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 1)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=60) == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


@pytest.mark.fresh
def test_the_progress_bar_is_not_overwritten_and_its_clocks_are_labelled(tmp_path):
    """On a terminal, a log line written while the bar is drawn (selective_backprop's, at
    start-up) clears the bar's line first instead of running on after its last clock; the two
    clocks say which is the elapsed and which the remaining time."""
    import re

    args = ["model=mlp", "dataset.num_train=128", "dataset.num_test=32", "trainer.max_epochs=1",
            "selective_backprop.keep=0.5", "logger=none", "trainer.plot_curves=false",
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    text = _on_a_terminal(args, tmp_path)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", text)  # colours off; the cursor codes stay
    assert "elapsed 0:00:0" in plain and "left " in plain
    # (on main: "... left -:--:--[2026-12-06 ...][accel_train][INFO] - selective_backprop...")
    assert re.search(r"(-:--:--|\d:\d\d:\d\d) *\[\d{4}-\d\d-\d\d ", plain) is None, plain
    assert "selective_backprop: keep" in plain


# A user's data set whose items print a line in the Ray data worker (once, for item 0).
LOUD_DATA = """
import torch
from torch.utils.data import Dataset


class Loud(Dataset):
    classes = ["dark", "bright"]

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 0:
            print("a line from the data worker", flush=True)
        return torch.full((1, 8, 8), float(i % 2)), i % 2


def build():
    return Loud(64), Loud(16), Loud(16)
"""


@pytest.mark.fresh
def test_loader_ray_shows_the_pool_on_the_console_without_colour_codes(run_cli, tmp_path):
    """loader=ray (a local Ray for the run): each logging line carries the pool's output and
    load (data/remote_*), and the output, not a terminal, holds no ANSI colour codes (Ray's
    coloured `(pid=...)` prefixes are off there)."""
    pytest.importorskip("ray")
    from grpo_fixtures import user_code

    env = user_code(tmp_path / "code", {"loud_data.py": LOUD_DATA})
    args = ["model=mlp", "dataset=custom", "dataset._target_=loud_data.build",
            "trainer.max_steps=4", "trainer.log_every_n_steps=2", "loader=ray",
            "loader.num_workers=1", "loader.batch_size=16", "trainer.progress=plain",
            "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = run_cli(args, timeout=240, env=env)
    check_ok(proc)
    text = proc.stdout + proc.stderr
    assert "pid=" in text and "a line from the data worker" in text  # Ray's prefixed line
    lines = [x for x in text.splitlines() if " step " in x and "  loss=" in x]
    assert lines and all("remote=" in x and "remote_busy=" in x for x in lines), text[-3000:]
    assert "\x1b[" not in text


def test_clips_per_video_draws_several_clips_of_each_video_an_epoch(run_cli, tmp_path):
    """dataset.clips_per_video=3: an epoch trains on 3 entries of each training video, each
    its own clip (window, crop, flip), so 3x the steps; the evaluation splits are unchanged."""
    pytest.importorskip("av")
    pytest.importorskip("torchcodec")
    from accel_train.data.video.folder import build_video_folder

    root = _two_second_clips(tmp_path / "data", 3)  # 2 classes: 4 training videos, 2 held out
    args = ["model=video_cnn", "dataset=video_folder", f"dataset.root={root}", cache(root),
            "dataset.clips_per_video=3", "dataset.image_size=32", "dataset.resize_size=32",
            "dataset.frames=4", "dataset.eval_clips=1", "loader.batch_size=4",
            "trainer.max_epochs=1", *QUIET, f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = run_cli(args)
    check_ok(proc)
    text = proc.stdout + proc.stderr
    assert "data video_folder: 12 train / 2 val / 6 test" in text, text[-2000:]
    assert "3 optimizer steps (3 per epoch" in text
    splits = build_video_folder(root=str(root), clips_per_video=3, frames=4, image_size=32,
                                resize_size=32, metadata_cache=str(root.parent / "mc"))  # fmt: skip
    train = splits.train
    clips = [train[i][0] for i in (0, 4, 8)]  # one video's three entries
    assert {train[i][1] for i in (0, 4, 8)} == {train[0][1]}
    assert not torch.equal(clips[0], clips[1]) and not torch.equal(clips[1], clips[2])
