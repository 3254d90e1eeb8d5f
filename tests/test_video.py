"""dataset=video_folder (issue 49) through the real CLI, on videos generated here: a bright square
moving left, right, up or down on a dark background (the direction is the class, so one frame
cannot tell it), 32 x 32 px, 16 frames, MPEG-4 part 2 through PyAV.

- Temporal order is real: the tiny 3-D CNN (model=video_cnn) reaches >= 90 % video accuracy on
  the test videos; fed its clips' frames in a shuffled order (dataset.shuffle_frames, the
  ablation), it stays near chance (the square's positions would still tell the axis, a row or a
  column, so 0.5 bounds it; the tiny model stays at 0.25).
- The test split is scored by multi-clip evaluation (eval_clips x eval_crops views per video,
  val/clip_acc beside the video accuracy), also by accel-eval.
- A mid-epoch resume with 2 loader workers ends with the weights of the uninterrupted run with
  none (the batches do not depend on the number of workers); loader=ray gives the same weights.
- The header check refuses empty, audio-only, garbage and too-short files in one paragraph naming
  all of them; dataset.pad_short=true trains on a too-short video.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_weights, check_ok, losses, read_jsonl, summary

av = pytest.importorskip("av")
pytest.importorskip("torchcodec")

DIRECTIONS = {"down": (1, 0), "left": (0, -1), "right": (0, 1), "up": (-1, 0)}
SIDE, FRAMES, SQUARE = 32, 16, 6


def write_video(path: Path, direction: str, seed: int, frames: int = FRAMES) -> None:
    """A square moving one pixel a frame in `direction`, from a seeded start."""
    rng = np.random.default_rng(seed)
    dy, dx = DIRECTIONS[direction]
    y0, x0 = (int(v) for v in rng.integers(SQUARE, SIDE - 2 * SQUARE, 2))
    y0, x0 = y0 - dy * frames // 4, x0 - dx * frames // 4  # centred on the start drawn
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=15)
        stream.width = stream.height = SIDE
        stream.pix_fmt = "yuv420p"
        for t in range(frames):
            img = np.full((SIDE, SIDE, 3), 20, np.uint8)
            y, x = max(y0 + dy * t, 0), max(x0 + dx * t, 0)
            img[y : y + SQUARE, x : x + SQUARE] = 230
            out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(stream.encode())


def write_tree(root: Path, per_class: dict[str, int], seed: int = 0) -> Path:
    n = seed
    for split, count in per_class.items():
        for d in DIRECTIONS:
            (root / split / d).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                write_video(root / split / d / f"{i:03d}.mp4", d, seed=n)
                n += 1
    return root


@pytest.fixture(scope="session")
def videos(tmp_path_factory) -> Path:
    """12 training videos per class (10 % held out for validation) and 6 test videos."""
    return write_tree(tmp_path_factory.mktemp("videos") / "data", {"train": 12, "test": 6})


EPOCHS = 10
STEPS_PER_EPOCH = 6  # 44 training videos (4 held out) in batches of 8, the last one short


def args(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "dataset=video_folder",
        f"dataset.root={root}",
        "dataset.frames=8",
        "dataset.frame_stride=1",
        "dataset.image_size=32",
        "dataset.resize_size=32",
        "dataset.crop_scale=[0.7,1.0]",
        "dataset.random_hflip=false",  # a flip turns left into right
        "dataset.eval_clips=2",
        # Beside the data, never in the user's ~/.cache (test_video_cache.py tests the default).
        f"dataset.metadata_cache={root.parent / 'metadata-cache'}",
        "model=video_cnn",
        "optimizer=adamw",
        "optimizer.lr=0.003",
        "loader.batch_size=8",
        # best.pt by the loss: 4 validation videos reach an accuracy of 1 early, undertrained.
        "checkpoint.monitor=val/loss",
        "checkpoint.mode=min",
        f"trainer.max_epochs={EPOCHS}",
        "trainer.deterministic=true",
        "trainer.log_every_n_steps=1",
        "trainer.progress=none",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(videos, tmp_path_factory, run_cli_in) -> dict[str, Path]:
    """The module's training runs, two at a time: the reference (no loader workers), the same
    with shuffled frames, and a run with 2 workers stopped mid-epoch then resumed."""
    cwd = tmp_path_factory.mktemp("video-runs")
    dirs = {name: cwd / name for name in ("ordered", "shuffled", "resumed")}
    stop = STEPS_PER_EPOCH + 3  # in the second epoch

    def ordered():
        check_ok(run_cli_in(args(videos, dirs["ordered"]), cwd))

    def shuffled():
        check_ok(run_cli_in(args(videos, dirs["shuffled"], "dataset.shuffle_frames=true"), cwd))

    def resumed():
        common = args(videos, dirs["resumed"], "loader.num_workers=2", "resume=auto")
        check_ok(run_cli_in([*common, f"trainer.max_steps={stop}"], cwd))
        dirs["stopped_losses"] = losses(dirs["resumed"])
        check_ok(run_cli_in(common, cwd))

    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(ordered), pool.submit(resumed)]:
            f.result()
        pool.submit(shuffled).result()
    return dirs


def test_temporal_order_is_learned_and_shuffled_frames_are_not(runs):
    ordered, shuffled = summary(runs["ordered"]), summary(runs["shuffled"])
    assert ordered["test_acc"] >= 0.9, ordered
    # Shuffled frames could still tell the axis (the positions lie on a row or a column), not the
    # direction: 0.5 at most; the tiny model does not even learn that (0.25 as measured).
    assert shuffled["test_acc"] <= 0.5, shuffled
    assert ordered["test_acc"] - shuffled["test_acc"] >= 0.3


def test_the_test_split_is_scored_by_multi_clip_evaluation(runs, run_cli, tmp_path):
    rows = read_jsonl(runs["ordered"] / "metrics.jsonl")
    test = [r for r in rows if "test/acc" in r][-1]
    assert {"test/acc", "test/clip_acc", "test/loss"} <= set(test)
    val = [r for r in rows if "val/acc" in r]
    assert val and all("val/clip_acc" in r for r in val)
    out = tmp_path / "eval.json"
    ckpt = runs["ordered"] / "checkpoints" / "best.pt"  # (the test split is scored with it)
    proc = run_cli([f"ckpt_path={ckpt}", "split=test", f"out_path={out}"], prog="accel-eval")
    check_ok(proc)
    scored = json.loads(out.read_text())
    assert scored["test/acc"] == pytest.approx(test["test/acc"])
    assert scored["test/clip_acc"] == pytest.approx(test["test/clip_acc"])
    # torch.export of the 3-D CNN, checked on the test views (each view scored as a sample).
    artifact = tmp_path / "model.pt2"
    proc = run_cli([f"ckpt_path={ckpt}", "format=torch_export", f"out_path={artifact}"],
                   prog="accel-export")  # fmt: skip
    check_ok(proc)
    assert artifact.is_file() and "argmax agreement 100.0000%" in proc.stdout + proc.stderr


def test_a_mid_epoch_resume_with_workers_equals_the_run_without(runs):
    stopped = runs["stopped_losses"]
    reference = losses(runs["ordered"])
    # Before the stop: the same batches with 2 workers as with none, step for step.
    assert sorted(stopped) == list(range(1, STEPS_PER_EPOCH + 4))
    assert all(stopped[s] == reference[s] for s in stopped)
    resumed = losses(runs["resumed"])
    assert all(resumed[s] == reference[s] for s in resumed)
    assert_same_weights(
        runs["resumed"] / "checkpoints" / "last.pt", runs["ordered"] / "checkpoints" / "last.pt"
    )


def test_the_header_check_names_every_bad_file_at_once(videos, run_cli, tmp_path):
    root = tmp_path / "data"
    write_tree(root, {"train": 2})
    bad = root / "train" / "left"
    (bad / "empty.mp4").write_bytes(b"")
    (bad / "garbage.mp4").write_bytes(b"\x00not a video\xff" * 200)
    write_video(bad / "short.mp4", "left", seed=99, frames=5)
    with av.open(str(bad / "sound.mp4"), "w") as out:  # audio only
        stream = out.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), "fltp", "mono")
        frame.sample_rate = 16000
        out.mux(stream.encode(frame))
        out.mux(stream.encode())
    proc = run_cli(args(root, tmp_path / "run", "trainer.max_steps=1"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    paragraph = [line for line in proc.stderr.splitlines() if "cannot give a clip" in line]
    assert len(paragraph) == 1, proc.stderr[-3000:]
    for name in ("empty.mp4", "garbage.mp4", "short.mp4", "sound.mp4"):
        assert str(bad / name) in paragraph[0], name
    assert "dataset.pad_short=true" in paragraph[0]
    assert not (tmp_path / "run" / "checkpoints").exists()

    for name in ("empty.mp4", "garbage.mp4", "sound.mp4"):
        (bad / name).unlink()
    extra = ("trainer.max_steps=2", "dataset.pad_short=true", "dataset.val_fraction=0.5")
    ok = run_cli(args(root, tmp_path / "padded", *extra))
    check_ok(ok)


def test_items_are_uint8_clips_and_views(videos):
    from accel_train.data.video.folder import build_video_folder

    splits = build_video_folder(root=str(videos), frames=4, frame_stride=2, image_size=24,
                                resize_size=28, eval_clips=3, eval_crops=3)  # fmt: skip
    x, y = splits.train.getitem(0, epoch=1)
    assert x.dtype == torch.uint8 and tuple(x.shape) == (3, 4, 24, 24)
    assert torch.equal(x, splits.train.getitem(0, epoch=1)[0])  # seeded by (seed, epoch, index)
    assert not torch.equal(x, splits.train.getitem(0, epoch=2)[0])
    views, _ = splits.test[0]
    assert views.dtype == torch.uint8 and tuple(views.shape) == (9, 3, 4, 24, 24)
    assert splits.num_classes == 4 and splits.image_size == 24


def test_loader_ray_trains_on_videos(videos, runs, tmp_path):
    """The same clips made by Ray actors: the mid-epoch run's weights, made by loader=torch."""
    from ray_head import Head
    from test_ray_loader import finish, ray_args, start

    (tmp_path / "ray").mkdir()
    head = Head(tmp_path / "ray", object_store_mb=100)
    try:
        extra = ray_args(head, "loader.num_workers=2", f"trainer.max_steps={STEPS_PER_EPOCH + 3}")
        code, out = finish(start(head, args(videos, tmp_path / "ray-run", *extra), tmp_path))
    finally:
        head.stop()
    assert code == 0, out[-3000:]
    reference = runs["stopped_losses"]
    assert losses(tmp_path / "ray-run") == reference


def test_the_yaml_keys_are_the_builder_arguments():
    import inspect

    from omegaconf import OmegaConf

    from accel_train.config import CONFIG_DIR
    from accel_train.data.video.folder import build_video_folder

    cfg = OmegaConf.load(CONFIG_DIR / "dataset" / "video_folder.yaml")
    params = inspect.signature(build_video_folder).parameters
    consumed = {"defaults", "_target_", "name", "num_classes", "mean", "std", "random_shift"}
    values = OmegaConf.to_container(cfg)
    assert set(cfg) - consumed == set(params)
    # An interpolation (metadata_cache's ${oc.env:XDG_CACHE_HOME,...}) is Hydra's to resolve:
    # a library call has no cache (None) unless given one.
    resolved = {k for k, v in values.items() if isinstance(v, str) and "${" in v}
    assert resolved == {"metadata_cache"} and params["metadata_cache"].default is None
    for key, p in params.items():
        if p.default is not p.empty and key not in resolved:
            default = list(p.default) if isinstance(p.default, tuple) else p.default
            assert values[key] == default, key


def test_decode_gpu_items_decode_on_the_device_to_the_cpu_items(videos):
    """decode=gpu's plans (drawn in the workers, decoded by the device transform) give the
    decode=cpu items; on the CPU here, as nvJPEG's path is tested (CUDA decodes with NVDEC)."""
    from accel_train.data.video.folder import build_video_folder

    def build(decode):
        return build_video_folder(root=str(videos), frames=4, image_size=24, resize_size=28,
                                  eval_clips=2, eval_crops=3, decode=decode)  # fmt: skip

    cpu, gpu = build("cpu"), build("gpu")
    for split in ("train", "test"):
        items = [getattr(cpu, split).getitem(i, 3) for i in (0, 5)]
        batch, labels = getattr(gpu, split).collate(
            [getattr(gpu, split).getitem(i, 3) for i in (0, 5)]
        )
        decoded = batch.decode_on(torch.device("cpu"))
        assert torch.equal(decoded, torch.stack([x for x, _ in items]))
        assert labels.tolist() == [y for _, y in items]


def test_a_list_file_with_segments(videos, tmp_path):
    """CSV rows path,label,start,end (a header first) and JSONL: class names sorted into
    indices, each segment's frames the window clips are drawn from."""
    from accel_train.data.video.folder import build_video_folder

    rows = ["path,label,start,end", "train/up/000.mp4,up,0.2,0.8", "train/left/000.mp4,left,,"]
    rows += [f"train/{d}/{i:03d}.mp4,{d},," for d in DIRECTIONS for i in (1, 2)]
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    lines = [{"path": f"test/{d}/000.mp4", "label": d} for d in ("up", "down")]
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    splits = build_video_folder(root=str(videos), list_file=str(tmp_path / "train.csv"),
                                test_list_file=str(tmp_path / "test.jsonl"), frames=4,
                                image_size=24, resize_size=28, val_fraction=0.0)  # fmt: skip
    assert splits.num_classes == 4 and len(splits.train) == 10 and len(splits.test) == 2
    assert splits.train.labels[:2].tolist() == [3, 1]  # down, left, right, up
    assert splits.train.bounds[0].tolist() == [3, 12]  # 0.2 s .. 0.8 s at 15 fps
    assert splits.train.bounds[1].tolist() == [0, FRAMES]


def test_clips_on_the_device_transform_and_channels_last_3d():
    """(N, C, T, H, W) normalised per channel; evaluation views (N, V, ...) flattened to N * V
    clips; channels_last is channels_last_3d for clips and for Conv3d weights."""
    from omegaconf import OmegaConf

    from accel_train.data.splits import Splits
    from accel_train.data.transform import BatchTransform
    from accel_train.models.video_cnn import video_cnn
    from accel_train.techniques.channels_last import to_channels_last

    ds = OmegaConf.create({"mean": [0.5, 0.25, 0.0], "std": [0.5, 0.25, 1.0]})
    splits = Splits(None, None, None, in_channels=3, image_size=8, num_classes=4)
    transform = BatchTransform(ds, splits, torch.device("cpu"), torch.float32, seed=0, rank=0)
    transform.memory_format = torch.channels_last
    clips = torch.full((2, 3, 4, 8, 8), 255, dtype=torch.uint8)
    x = transform(clips, train=True)
    assert x.is_contiguous(memory_format=torch.channels_last_3d)
    assert x[:, :, 0, 0, 0].tolist() == [[1.0, 3.0, 1.0]] * 2
    views = transform(clips[:, None].expand(2, 5, 3, 4, 8, 8), train=False)
    assert tuple(views.shape) == (10, 3, 4, 8, 8)
    model = to_channels_last(video_cnn(in_channels=3, num_classes=4))
    assert model.stages[0][0].weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert tuple(model(x).shape) == (2, 4)


def test_without_torchcodec_the_error_says_what_to_install(monkeypatch):
    import sys

    from accel_train.data.video import decode as video_decode
    from accel_train.errors import UserError

    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)  # the import fails
    with pytest.raises(UserError) as err:
        video_decode.video_metadata("any.mp4")
    assert "apt-get install ffmpeg" in str(err.value)
    assert "accel-train[video]" in str(err.value)


def test_decode_gpu_is_refused_on_the_cpu(videos, run_cli, tmp_path):
    proc = run_cli(args(videos, tmp_path / "run", "dataset.decode=gpu", "trainer.device=cpu"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "NVDEC" in proc.stderr and "dataset.decode=cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_video_broken_after_the_check_fails_in_a_worker_in_one_paragraph(tmp_path):
    from torch.utils.data import DataLoader

    from accel_train.data.video.decode import VideoReadError
    from accel_train.data.video.folder import build_video_folder

    root = write_tree(tmp_path / "data", {"train": 2})
    splits = build_video_folder(root=str(root), frames=4, image_size=24, resize_size=28)
    broken = Path(splits.train.path(0))
    broken.write_bytes(b"\x00garbage" * 100)
    loader = DataLoader(splits.train, batch_size=2, num_workers=1)
    with pytest.raises(VideoReadError) as err:
        next(iter(loader))
    text = str(err.value)
    assert text.startswith(f"dataset=video_folder: {broken} cannot be decoded")
    assert "Traceback" not in text and "\n" not in text
