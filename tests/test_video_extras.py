"""Video beyond the data core (issue 49), through the real CLI, on tests/test_video.py's moving
squares (32 x 32 px, 16 frames at 15 fps):

- `model=torchvision model.name=r3d_18` trains on clips from a local weights file of another
  head size (the head starts fresh, the log says so), in channels_last_3d, evaluates the test
  split by several clips a video, and `accel-export` writes a torch.export program of 5-D input
  that agrees with the model; an image classifier on clips, a video classifier on images (the
  model's `input_rank` against the data's first batch) and an MViT at another clip size than its
  own are refused in one paragraph.
- `accel-data shard dataset=video_folder` writes the splits `dataset=video_folder` trains on;
  `dataset=streaming_video` draws from them exactly the clips the folder gives (the same pixels,
  training and evaluation views); `fps=` re-encodes at a lower rate, which the index records and
  the streaming option trains on; `gop=4` re-encodes videos of sparser key frames (at their size
  and rate) with a key frame every 4 frames, a negative one is refused; clips longer than the
  stored videos are refused before a chunk is read; a shard set is replaced only with
  `overwrite=true`, never the videos' folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import check_ok

pytest.importorskip("torchcodec")
pytest.importorskip("litdata")
from test_video import write_tree  # noqa: E402 - (needs av, skipped with it)

CLIP = ["dataset.frames=8", "dataset.frame_stride=1", "dataset.image_size=32"]
CLIP += ["dataset.resize_size=32", "dataset.eval_clips=2"]
QUIET = ["trainer.progress=none", "logger=none"]


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> Path:
    """4 training videos a class (1 held out for validation) and 2 test videos a class."""
    return write_tree(tmp_path_factory.mktemp("videos") / "data", {"train": 4, "test": 2})


def folder(root: Path) -> list[str]:
    cache = f"dataset.metadata_cache={root.parent / 'metadata-cache'}"  # not the user's ~/.cache
    return ["dataset=video_folder", f"dataset.root={root}", "dataset.val_fraction=0.25", cache,
            *CLIP]  # fmt: skip


def refused(proc, *words: str) -> str:
    """The one-paragraph error of a refused command, checked to name `words`."""
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = next((x for x in proc.stderr.splitlines() if "error:" in x), "")
    for word in words:
        assert word in line, proc.stderr[-3000:]
    return line


def test_a_torchvision_video_model_trains_and_exports(videos, run_cli, tmp_path):
    from torchvision.models.video import r3d_18

    weights = tmp_path / "r3d_18-kinetics.pth"  # Kinetics' 400 classes: the head cannot fit
    torch.save(r3d_18(num_classes=400).state_dict(), weights)
    run = tmp_path / "run"
    proc = run_cli([
        "model=torchvision", "model.name=r3d_18", f"model.weights={weights}", *folder(videos),
        "trainer.channels_last=true", "trainer.max_steps=2", "loader.batch_size=4",
        f"hydra.run.dir={run}", *QUIET,
    ])  # fmt: skip
    check_ok(proc)
    log = proc.stdout + proc.stderr
    assert "the head (fc) has 400 outputs in the file and 4 here" in log, log[-3000:]
    assert "channels_last" in log
    summary = json.loads((run / "summary.json").read_text())
    assert {"test_acc", "test_clip_acc"} <= set(summary), summary

    out = tmp_path / "r3d_18.pt2"
    exported = run_cli(
        [f"ckpt_path={run / 'checkpoints' / 'last.pt'}", "format=torch_export",
         f"out_path={out}", "verify_samples=8"],
        prog="accel-export",
    )  # fmt: skip
    check_ok(exported)
    card = json.loads(out.with_name(out.name + ".json").read_text())
    assert card["input"]["shape"] == ["batch", 3, 8, 32, 32], card["input"]
    assert card["verification"]["passed"] and card["verification"]["samples"] == 8
    program = torch.export.load(out).module()
    assert program(torch.randn(3, 3, 8, 32, 32)).shape == (3, 4)


def test_the_wrong_kind_of_model_is_refused(videos, run_cli, tmp_path):
    proc = run_cli(["model=torchvision", "model.name=r3d_18", "trainer.max_steps=1", *QUIET])
    refused(proc, "the model takes clips (batch, channels, frames,", "dataset=video_folder")
    clips = [*folder(videos), "trainer.max_steps=1", *QUIET]
    proc = run_cli(["model=torchvision", "model.name=resnet18", *clips])
    refused(proc, "the model takes images", "(2, 3, 8, 32, 32)", "r2plus1d_18")
    proc = run_cli(["model=torchvision", "model.name=mvit_v2_s", *clips])
    refused(proc, "16 frames of 224 px", "dataset.frames=16 dataset.image_size=224")


@pytest.fixture(scope="module")
def shards(videos, tmp_path_factory, run_cli_in) -> dict:
    """The videos sharded as they are, re-encoded at half their frame rate, and re-encoded with a
    key frame every 4 frames (mpeg4's own interval, 12, is sparser)."""
    cwd = tmp_path_factory.mktemp("video-shards")
    made = {"same": cwd / "same", "half": cwd / "half", "dense": cwd / "dense"}
    check_ok(run_cli_in(["shard", *folder(videos), f"out={made['same']}"], cwd, prog="accel-data"))
    half = ["shard", *folder(videos), "fps=7.5", f"out={made['half']}"]
    check_ok(run_cli_in(half, cwd, prog="accel-data"))
    dense = ["shard", *folder(videos), "gop=4", f"out={made['dense']}"]
    proc = run_cli_in(dense, cwd, prog="accel-data")
    check_ok(proc)
    return {**made, "dense_log": proc.stdout}


def keyframes(data: bytes) -> tuple[list[int], int]:
    """The positions of an MP4's key frames (PyAV, presentation order) and its frame count."""
    import io

    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        packets = sorted(
            (p.pts, p.is_keyframe) for p in container.demux(stream) if p.pts is not None
        )
    return [i for i, (_, key) in enumerate(packets) if key], len(packets)


def test_gop_puts_a_key_frame_every_n_frames(videos, shards, run_cli):
    from litdata import StreamingDataset

    index = json.loads((shards["dense"] / "accel_train.index.json").read_text())
    total = sum(info["samples"] for info in index["splits"].values())
    assert index["gop"] == 4 and f"({total} re-encoded)" in shards["dense_log"], shards["dense_log"]
    for info in index["splits"].values():  # (the same rate and size: only the GOP changed)
        assert set(info["fps"]) == {15.0} and all(w == [0, 16] for w in info["window"])
    for name, want in (("dense", [0, 4, 8, 12]), ("same", [0, 12])):
        item = StreamingDataset(str(shards[name] / "train"))[0]
        assert keyframes(item["video"]) == (want, 16), name  # "same": the source's own bytes
    assert json.loads((shards["same"] / "accel_train.index.json").read_text())["gop"] == 32
    refused(run_cli(["shard", *folder(videos), "gop=-1", "out=x"], prog="accel-data"), "gop=-1")


def test_streamed_clips_are_the_folders_clips(videos, shards):
    from litdata import StreamingDataset

    from accel_train.data.video.folder import build_video_folder
    from accel_train.data.video.streaming import build_streaming_video

    keys = dict(frames=8, frame_stride=1, image_size=32, resize_size=32, eval_clips=2, seed=0)
    files = build_video_folder(root=str(videos), val_fraction=0.25, **keys)
    streamed = build_streaming_video(remote=str(shards["same"]), **keys)
    for name in ("val", "test"):
        a, b = getattr(files, name), getattr(streamed, name)
        assert len(a) == len(b) > 0
        for i in range(len(a)):
            (x, y), (u, v) = a[i], b[i]
            assert x.shape == (2, 3, 8, 32, 32) and y == v and torch.equal(x, u), (name, i)
    raw = StreamingDataset(str(shards["same"] / "train"))
    decoder = streamed.train.source.decoder
    for k in range(len(raw)):
        item = raw[k]
        for epoch in (0, 1):
            clip, label = decoder(item, epoch)
            want, y = files.train.getitem(int(item["index"]), epoch)
            assert label == y and torch.equal(clip, want), (k, epoch)


def test_reencoded_shards_train_and_short_clips_are_refused(shards, run_cli, tmp_path):
    index = json.loads((shards["half"] / "accel_train.index.json").read_text())
    assert index["kind"] == "video_folder" and index["fps"] == 7.5
    assert index["classes"] == ["down", "left", "right", "up"]
    for info in index["splits"].values():
        assert set(info["fps"]) == {7.5} and all(w == [0, 8] for w in info["window"])
    stream = ["dataset=streaming_video", f"dataset.remote={shards['half']}", *CLIP]
    run = tmp_path / "run"
    check_ok(run_cli([*stream, "model=video_cnn", "trainer.max_steps=3", "loader.batch_size=4",
                      f"hydra.run.dir={run}", *QUIET]))  # fmt: skip
    summary = json.loads((run / "summary.json").read_text())
    assert {"test_acc", "test_clip_acc"} <= set(summary), summary

    proc = run_cli([*stream, "dataset.frames=16", "model=video_cnn", "trainer.max_steps=1", *QUIET])
    refused(proc, "shorter than a clip", "train sample 0 (8 frames)", "dataset.pad_short=true")
    proc = run_cli(["dataset=streaming", f"dataset.remote={shards['half']}", *QUIET])
    refused(proc, "holds video shards", "dataset=streaming_video")


def test_a_video_shard_set_is_replaced_only_when_asked(videos, shards, run_cli, tmp_path):
    out = shards["same"]  # (written again as it was: the other tests read it too)
    before = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again = ["shard", *folder(videos), f"out={out}"]
    refused(run_cli(again, prog="accel-data"), "overwrite=true")
    assert {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before
    check_ok(run_cli([*again, "overwrite=true"], prog="accel-data"))
    after = {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert after.keys() == before.keys() and all(after[k] != before[k] for k in before)
    inside = ["shard", *folder(videos), f"out={videos / 'shards'}"]
    refused(run_cli(inside, prog="accel-data"), "dataset.root")
    assert not (videos / "shards").exists()
