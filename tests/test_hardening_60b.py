"""Issue 60 (Hardening 5), second part, through the real CLI: a torchcodec without FFmpeg's
libraries is named once as the installation, never as the videos."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import check_ok

NO_FFMPEG = (
    "Could not load libtorchcodec. Likely causes: 1. FFmpeg is not properly installed in your "
    "environment. We support versions 4, 5, 6, 7 and 8."
)


def _fake_torchcodec(where: Path) -> Path:
    """A torchcodec that imports but cannot load FFmpeg's libraries (torchcodec >= 0.7 without
    FFmpeg): its decoders raise torchcodec's RuntimeError when opened."""
    pkg = where / "fake" / "torchcodec"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    raising = f"    raise RuntimeError({NO_FFMPEG!r})\n"
    (pkg / "_internally_replaced_utils.py").write_text("def load_core_libraries():\n" + raising)
    (pkg / "decoders.py").write_text(
        "class VideoDecoder:\n    def __init__(self, *args, **kwargs):\n"
        + raising.replace("    ", "        ", 1)
        + "\n\nAudioDecoder = VideoDecoder\n"
    )
    return where / "fake"


def test_no_ffmpeg_is_the_installation_not_the_videos(run_cli, tmp_path):
    for split in ("train", "test"):
        for label in ("a", "b"):
            folder = tmp_path / "data" / split / label
            folder.mkdir(parents=True)
            for i in range(3):
                (folder / f"{i}.mp4").write_bytes(b"not checked: the libraries fail first")
    fake = _fake_torchcodec(tmp_path)
    path = os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    args = ["dataset=video_folder", f"dataset.root={tmp_path / 'data'}", "model=video_cnn",
            "logger=none", "trainer.progress=none"]  # fmt: skip
    proc = run_cli(args, env={"PYTHONPATH": path})
    text = proc.stderr
    assert proc.returncode == 2, text
    assert "cannot load FFmpeg's shared libraries" in text and "libtorchcodec" in text
    assert "apt-get install ffmpeg" in text and "conda-forge 'ffmpeg<8'" in text
    assert "not at fault" in text
    assert "move" not in text and "0.mp4" not in text and "Traceback" not in text
    assert text.count("Could not load libtorchcodec") == 1


def test_a_recipe_key_the_run_dataset_lacks_names_the_recipe_line(run_cli, tmp_path):
    """+experiment=gpt_char sets dataset.windows_per_epoch, which dataset=tokens has and
    dataset=streaming_tokens does not: one paragraph naming the recipe, the key and the options
    it fits, not "add it with a `+`" (a recipe cannot)."""
    args = ["+experiment=gpt_char", "dataset=streaming_tokens", f"dataset.remote={tmp_path}/x"]
    proc = run_cli(args)
    assert proc.returncode == 2
    text = proc.stderr
    assert "experiment/gpt_char.yaml sets dataset.windows_per_epoch" in text
    assert "a key of dataset=tokens" in text and "dataset=streaming_tokens does not" in text
    assert "with a `+`" not in text and "Traceback" not in text


def test_a_timm_model_says_whether_its_weights_are_random_or_loaded(run_cli, tmp_path):
    """One start-up line says whether model=timm starts from random weights or a file's."""
    pytest.importorskip("timm")
    from torchvision.io import encode_jpeg, write_file

    for c in range(2):
        (tmp_path / "photos" / "train" / f"c{c}").mkdir(parents=True)
        for k in range(4):
            img = torch.full((3, 16, 16), 40 + 150 * c, dtype=torch.uint8)
            write_file(str(tmp_path / "photos" / "train" / f"c{c}" / f"{k}.jpg"), encode_jpeg(img))
    args = ["model=timm", "model.name=resnet10t", "dataset=image_folder", "dataset.image_size=16",
            f"dataset.root={tmp_path / 'photos'}", "dataset.val_fraction=0.25",
            "loader.batch_size=2", "logger=none", "+debug=fast_dev_run",
            "checkpoint.save_last=true"]  # fmt: skip
    run = tmp_path / "run"
    proc = run_cli([*args, f"hydra.run.dir={run}"])
    check_ok(proc)
    assert "model: timm resnet10t, random weights" in proc.stdout + proc.stderr
    last = run / "checkpoints" / "last.pt"
    proc = run_cli([*args, f"model.weights={last}", f"hydra.run.dir={tmp_path / 'again'}"])
    check_ok(proc)
    assert f"model: timm resnet10t, weights from {last}" in proc.stdout + proc.stderr
