"""Issue 60 (Hardening 5), through the real CLI: trainer.max_steps without trainer.max_epochs
trains by steps; best.pt is considered at every validation, not only every_n_epochs'; a
schema's mapping (loader.resources) takes keys of the user's own without `+`; a misspelled
option names the nearest ones; a torchvision that does not match torch is named as the
installation, not as the data set's arguments."""

from __future__ import annotations

import json
from importlib import metadata
from importlib.util import find_spec

import pytest
import torch
import yaml
from helpers import FAST, check_ok, read_jsonl

# 256 samples, 10% held out: 230 train / 64 per batch = 4 steps per epoch (default: 3 epochs).
SHORT = [*FAST, "loader.batch_size=64", "trainer.test_after_fit=false"]


def _steps(run_dir) -> int:
    return json.loads((run_dir / "summary.json").read_text())["steps"]


def test_max_steps_alone_trains_by_steps(run_cli, tmp_path):
    """max_steps=20 alone: 20 steps (5 epochs), not the default max_epochs' 12; the batch line
    names the limit that ends the run. With max_epochs given too, the first limit reached."""
    run_dir = tmp_path / "steps"
    proc = run_cli([*SHORT, "trainer.max_steps=20", f"hydra.run.dir={run_dir}"])
    check_ok(proc)
    assert _steps(run_dir) == 20
    assert "trainer.max_steps=20 ends the run at step 20" in proc.stdout + proc.stderr
    both = tmp_path / "both"
    proc = run_cli(
        [*SHORT, "trainer.max_steps=20", "trainer.max_epochs=2", f"hydra.run.dir={both}"]
    )
    check_ok(proc)
    assert _steps(both) == 8
    assert "trainer.max_epochs=2 ends the run at step 8" in proc.stdout + proc.stderr
    # An experiment that sets max_epochs gives it as the command line does.
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    mine = "# @package _global_\ntrainer:\n  max_epochs: 2\n"
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(mine)
    ours = tmp_path / "experiment"
    search = f"hydra.searchpath=[file://{tmp_path / 'conf'}]"
    args = [*SHORT, search, "+experiment=mine", "trainer.max_steps=20", f"hydra.run.dir={ours}"]
    check_ok(run_cli(args))
    assert _steps(ours) == 8


def test_best_pt_is_the_best_of_every_validation(run_cli, tmp_path):
    """checkpoint.every_n_epochs=2 over 3 epochs ranks epochs 1 and 2 only; monitoring the
    *highest* val/loss makes epoch 0's validation (the least trained) the best: best.pt holds
    that epoch's weights and summary.json's best_score is the best value metrics.jsonl logged."""
    run_dir = tmp_path / "run"
    args = [
        *SHORT,
        "trainer.max_epochs=3",
        "checkpoint.every_n_epochs=2",
        "checkpoint.monitor=val/loss",
        "checkpoint.mode=max",
        f"hydra.run.dir={run_dir}",
    ]
    check_ok(run_cli(args))
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/loss" in r]
    assert len(rows) == 3
    best = max(rows, key=lambda r: r["val/loss"])
    assert best["step"] == rows[0]["step"] == 4  # after epoch 0, which is not due
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_score"] == best["val/loss"]
    saved = torch.load(run_dir / "checkpoints" / "best.pt", map_location="cpu", weights_only=False)
    assert saved["progress"]["step"] == best["step"]


def _user_dataset(cwd, error: str) -> list[str]:
    """A dataset `_target_` of the user's (a module in the run's cwd) that raises `error`."""
    (cwd / "broken_data.py").write_text(f"def build(**kwargs):\n    raise {error}\n")
    return ["model=mlp", "dataset=custom", "dataset._target_=broken_data.build"]


def test_loader_resources_takes_keys_of_the_users_own(run_cli, tmp_path):
    """loader.resources.cpu_node=1 (configs/loader/ray.yaml's own example) is accepted and lands
    in config.yaml; the run is then refused by its data set, before any Ray starts. The run dir
    made beforehand is kept (a refused run removes only a run dir it made)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = [
        *_user_dataset(tmp_path, 'ValueError("no data in this test")'),
        "loader=ray",
        "loader.resources.cpu_node=1",
        "trainer.progress=none",
        f"hydra.run.dir={run_dir}",
    ]
    proc = run_cli(args)
    assert proc.returncode != 0
    assert "no data in this test" in proc.stderr and "fixed by its schema" not in proc.stderr
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["loader"]["resources"] == {"cpu_node": 1.0}
    proc = run_cli(["loader=ray", "loader.resources_typo=1"])
    assert proc.returncode != 0 and "fixed by its schema" in proc.stderr  # the schema stays closed


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("strategy=fdsp", "strategy=fsdp"),
        ("precision=bf61", "precision=bf16"),
        ("launcher=torchrn", "launcher=torchrun"),
        ("scheduler=cosin", "scheduler=cosine"),
        ("logger=tensorbord", "logger=tensorboard"),
    ],
)
def test_a_misspelled_option_names_the_nearest(run_cli, given, meant):
    proc = run_cli([given])
    assert proc.returncode == 2
    assert f"Did you mean `{meant}`" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2


def test_a_torchvision_for_another_torch_is_an_installation_problem(run_cli, tmp_path):
    """A data set `_target_` failing as a mismatched torchvision does (its operators not
    registered) is reported as the installation: both versions and the install line."""
    error = 'RuntimeError("operator torchvision::nms does not exist")'
    proc = run_cli([*_user_dataset(tmp_path, error), "trainer.progress=none"])
    assert proc.returncode == 2
    text = proc.stderr
    assert "operator torchvision::nms does not exist" in text
    assert "Fix the arguments" not in text and "Traceback" not in text
    torch_version = metadata.version("torch")
    minor = int(torch_version.split(".")[1])
    assert f"torch {torch_version}" in text
    line = f"pip install torch=={torch_version.split('+')[0]} torchvision==0.{minor + 15}.*"
    assert line in text
    vision = metadata.version("torchvision") if find_spec("torchvision") else None
    assert vision is None or f"torchvision {vision}" in text
    # The user's own `from torchvision import nope` stays the user's code to fix.
    (tmp_path / "broken_data.py").write_text(
        "def build(**kwargs):\n    from torchvision import nope  # noqa\n"
    )
    proc = run_cli(["model=mlp", "dataset=custom", "dataset._target_=broken_data.build"])
    assert proc.returncode == 2 and "Fix the arguments" in proc.stderr
    assert "installation" not in proc.stderr
