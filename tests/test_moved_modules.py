"""Runs written before a module moved (issue 59: data/ into one sub-package per modality) keep
resuming and evaluating: their config.yaml and checkpoints name the old `_target_`s, which
config/moved.py's one mapping renames wherever a saved config is read back (and in a user's
own overrides)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import yaml
from helpers import check_ok, read_jsonl
from test_image_folder import write_image_folder

from accel_train.config.moved import MOVED, moved, renamed
from accel_train.config.run_config import load_run_config

# torchvision 0.29 deprecates torchvision.io's encoders (for TorchCodec) and warns on every call.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")

OLD_TARGET = "accel_train.data.image_folder.build_image_folder"
NEW_TARGET = "accel_train.data.images.folder.build_image_folder"


def test_moved_renames_only_what_moved():
    assert moved(OLD_TARGET) == NEW_TARGET
    assert moved("accel_train.data.image_folder") == "accel_train.data.images.folder"
    # A key is a whole module: `streaming` is not a prefix of `streaming_tokens`.
    assert moved("accel_train.data.streaming.build_streaming") == (
        "accel_train.data.images.streaming.build_streaming"
    )
    tokens = "accel_train.data.streaming_tokens"
    assert moved(f"{tokens}.build_streaming_tokens") == (
        MOVED.get(tokens, tokens) + ".build_streaming_tokens"
    )
    for same in ("accel_train.data.builtin.synthetic_splits", "my_pkg.image_folder.build", "x"):
        assert moved(same) == same
    tree = {"dataset": {"_target_": OLD_TARGET, "root": "/d"}, "model": {"_target_": "m.M"}}
    assert renamed(tree) == {**tree, "dataset": {"_target_": NEW_TARGET, "root": "/d"}}
    unchanged = {"dataset": {"_target_": NEW_TARGET}, "callbacks": [{"a": 1}]}
    assert renamed(unchanged) is unchanged


def test_every_new_path_imports_and_no_old_one_does():
    for old, new in MOVED.items():
        module, _, name = new.rpartition(".")
        try:
            importlib.import_module(new)
        except ModuleNotFoundError:  # an object's entry: module.Name
            assert hasattr(importlib.import_module(module), name), new
        try:
            importlib.import_module(old)
        except ModuleNotFoundError:
            continue
        raise AssertionError(f"{old} still imports: the mapping would hide it")


def _as_before_the_move(run_dir: Path) -> None:
    """Rewrite the run dir as an earlier version wrote it: config.yaml and every checkpoint's
    stored config name the dataset's old module."""
    config = run_dir / "config.yaml"
    text = config.read_text()
    assert NEW_TARGET in text
    config.write_text(text.replace(NEW_TARGET, OLD_TARGET))
    for ckpt in (run_dir / "checkpoints").glob("*.pt"):
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        assert state["config"]["dataset"]["_target_"] == NEW_TARGET
        state["config"]["dataset"]["_target_"] = OLD_TARGET
        torch.save(state, ckpt)


def _progress(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["progress"]


def test_a_run_written_before_the_move_resumes_and_evaluates(run_cli, tmp_path):
    root = write_image_folder(tmp_path / "data", 8, 4)
    run_dir = tmp_path / "run"
    common = [
        "dataset=image_folder",
        f"dataset.root={root}",
        "dataset.image_size=16",
        "model=mlp",
        "loader.batch_size=8",
        "trainer.progress=none",
        "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    check_ok(run_cli([*common, "trainer.max_epochs=1"]))
    steps = _progress(run_dir)["step"]
    _as_before_the_move(run_dir)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["dataset"]["_target_"] == OLD_TARGET
    # What a worker reads (torchrun's restart, a requeued SLURM job): the path as it is now.
    assert load_run_config(run_dir / "config.yaml").dataset._target_ == NEW_TARGET

    # accel-eval rebuilds the data set from the checkpoint's config (the old path).
    scored = run_cli([f"ckpt_path={run_dir / 'checkpoints' / 'last.pt'}"], prog="accel-eval")
    check_ok(scored)

    # The same command, one epoch longer, with resume=auto: the checkpoint's old path is the
    # dataset option's new one, not a changed data set. The user's own override naming the old
    # module (a script written before the move) means the same.
    proc = run_cli(
        [*common, "trainer.max_epochs=2", "resume=auto", f"dataset._target_={OLD_TARGET}"]
    )
    check_ok(proc)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if r.get("event") == "resume"] == [steps]
    assert _progress(run_dir)["step"] == 2 * steps
