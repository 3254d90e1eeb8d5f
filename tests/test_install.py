"""Installing and starting accel-train as a new user would: `--help`, a refused config, and a
wheel installed (not editable) into a fresh virtual environment, run from outside the checkout."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import FAST, check_ok
from omegaconf import OmegaConf

from accel_train.config import CONFIG_DIR

# About installation: its CLI runs start a new interpreter, never the warm parent
# (tests/warm_cli.py).
pytestmark = pytest.mark.fresh

ROOT = Path(__file__).resolve().parents[1]


def test_help_is_ours_and_lists_every_group_and_option(run_cli):
    proc = run_cli(["--help"], timeout=60)
    check_ok(proc)
    text = proc.stdout
    assert "powered by Hydra" not in text and text.startswith("accel-train: train a PyTorch")
    for group in (p for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name != "hydra"):
        spellings = (f"{group.name}=", f"+{group.name}=")
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(spellings))
        for option in group.glob("*.yaml"):
            assert option.stem in line, f"{group.name}={option.stem} missing from --help"
        assert "_schema" not in line  # the ConfigStore's typed schemas are not options
    assert "mnist_cnn*" in text and "+experiment=" in text  # the default marked; `+` groups
    examples = text.split("== Examples ==")[1].split("==")[0]
    assert sum(ln.strip().startswith("accel-train ") for ln in examples.splitlines()) >= 5
    # What users of the anchors look for first (issue 60 B.14): video, GRPO, timm, loader=ray.
    for needle in ("video_r2plus1d", "grpo_lora", "model=timm", "loader=ray"):
        assert needle in examples, needle
    # Each option with a line of its own saying what it is; every sibling command.
    assert re.search(r"^ +video_folder +Your own videos", text, re.M), text
    for sibling in ("accel-eval", "accel-data", "accel-export", "accel-sample", "accel-report"):
        assert f"  {sibling} " in text, sibling
    # The fast_dev_run example says what the config runs: one batch of each split.
    fdr = OmegaConf.load(CONFIG_DIR / "debug" / "fast_dev_run.yaml").trainer
    assert (fdr.limit_train_batches, fdr.limit_val_batches, fdr.limit_test_batches) == (1, 1, 1)
    line = next(ln for ln in examples.splitlines() if "+debug=fast_dev_run" in ln)
    assert "one batch of train, val, test" in line and "two batches" not in text
    proc = run_cli(["--help"], prog="accel-eval", timeout=60)
    check_ok(proc)
    assert proc.stdout.startswith("accel-eval: score a checkpoint") and "ckpt_path" in proc.stdout
    assert "powered by Hydra" not in proc.stdout


def test_a_refused_config_leaves_no_run_dir(run_cli, tmp_path):
    # Refused by the data set, after Hydra made the run dir (.hydra/, train.log, the lock) and
    # config.yaml was written: no outputs/ is left.
    proc = run_cli(["dataset=mnist", "dataset.download=false", "trainer.progress=none"])
    assert proc.returncode == 2 and "MNIST" in proc.stderr, proc.stderr
    assert not (tmp_path / "outputs").exists(), list((tmp_path / "outputs").rglob("*"))
    # A run dir that existed before (e.g. resume=auto into it) is left as it was.
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("keep me")
    refused = ["trainer.max_epochs=0", "trainer.max_steps=0", f"hydra.run.dir={run_dir}"]
    proc = run_cli([*FAST, *refused])
    assert proc.returncode == 2 and "nothing to train" in proc.stderr, proc.stderr
    assert (run_dir / "notes.txt").read_text() == "keep me"


def _throwaway_venv(tmp_path: Path) -> Path:
    """A venv without pip whose site-packages also sees this environment's (torch, hydra, ...:
    nothing is downloaded), but not this checkout: a .pth line adds the directory itself, so its
    editable-install .pth is not processed."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "_parent_env.pth").write_text("\n".join(sorted(ours)) + "\n")
    return venv


def test_a_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    # Build from a copy, so the checkout gets no build/ or egg-info of this test's making.
    src = tmp_path / "src-copy"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", src / "src", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("accel_train-*.whl")
    venv = _throwaway_venv(tmp_path)
    subprocess.run(
        [*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index"]
        + [str(wheel)],
        check=True,
        capture_output=True,
    )
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    env["ACCEL_TRAIN_DATA_DIR"] = str(work / "no-data-here")

    def run(prog: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(venv / "bin" / prog), *args],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import accel_train; print(accel_train.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(venv)), where  # the wheel's copy, not the checkout's
    # matplotlib is a core dependency (curves.png in every run dir), not behind an extra.
    requires = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; "
         "print('\\n'.join(m.requires('accel-train')))"],
        cwd=work, env=env, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert any(r.startswith("matplotlib") and "extra ==" not in r for r in requires), requires
    proc = run("accel-train", "--help")
    check_ok(proc)
    assert "model=" in proc.stdout and "mnist_cnn*" in proc.stdout
    # A user's own config dir (--config-dir) next to the packaged ones.
    (work / "my_configs" / "model").mkdir(parents=True)
    (work / "my_configs" / "model" / "tiny.yaml").write_text(
        "defaults:\n  - mlp_schema\n  - _self_\n_target_: accel_train.models.mlp\n"
        "name: mlp\nhidden_dims: [16]\n"
    )
    proc = run(
        "accel-train",
        "--config-dir",
        "my_configs",
        "model=tiny",
        *FAST[1:],
        "+debug=fast_dev_run",
        "checkpoint.save_last=true",  # fast_dev_run keeps none; accel-eval below reads last.pt
        "hydra.run.dir=run",
    )
    check_ok(proc)
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["steps"] == 1  # fast_dev_run: one batch each
    config = (work / "run" / "config.yaml").read_text()
    assert "hidden_dims:\n  - 16" in config or "hidden_dims: [16]" in config
    proc = run("accel-eval", "ckpt_path=run/checkpoints/last.pt")
    check_ok(proc)
    assert "test/acc=" in proc.stdout
