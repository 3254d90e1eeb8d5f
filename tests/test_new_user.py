"""What a new user of the language-model and task features hits first (issue 27), through the
real console scripts: every experiment's smoke run, a GPT on tokens without naming the task,
user data sets without `.classes`, sweep tables in the task's metric, lightning-hydra-template's
callback groups. Each data set is the test's own and tiny."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import check_ok, write_mnist

from accel_train.config import CONFIG_DIR

TEXT = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(100))


def _tokens(cwd: Path, run_cli) -> list[str]:
    (cwd / "input.txt").write_text(TEXT)
    check_ok(run_cli(["tokenize", "input=input.txt", "out=tokens"], cwd=cwd, prog="accel-data"))
    return ["dataset.path=tokens"]


def _mnist(cwd: Path, run_cli) -> list[str]:
    return [f"paths.data_dir={write_mnist(cwd / 'data')}"]


def _cifar_shaped(cwd: Path, run_cli) -> list[str]:
    # torchvision's CIFAR10 checks each file's MD5, so no tiny CIFAR-10 of a test's own loads:
    # the recipe runs on synthetic 3 x 32 x 32 images (its model, precision, loader, optimizer
    # and schedule are what the smoke run checks).
    return ["dataset=synthetic", "dataset.in_channels=3", "dataset.image_size=32"]


# Each experiment's data, made by the test: a new experiment must say what it needs here.
EXPERIMENT_DATA = {
    "cifar10_resnet18_bf16": _cifar_shaped,
    "gpt_char": _tokens,
    "mnist_amp": _mnist,
}


def test_every_experiment_names_its_test_data():
    assert {p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml")} == set(EXPERIMENT_DATA)


@pytest.mark.parametrize("experiment", sorted(EXPERIMENT_DATA))
def test_fast_dev_run_works_with_every_experiment(experiment, run_cli, tmp_path):
    """A smoke run is never refused for a schedule sized for the full run (gpt_char's 100
    warm-up steps against fast_dev_run's one step): the warm-up is shortened, said in the log."""
    data = EXPERIMENT_DATA[experiment](tmp_path, run_cli)
    args = [f"+experiment={experiment}", "+debug=fast_dev_run", *data, "trainer.progress=none"]
    proc = run_cli([*args, "hydra.run.dir=run"])
    check_ok(proc)
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["steps"] == 1
    if experiment == "gpt_char":
        assert "scheduler.warmup_steps=100 shortened to 0" in proc.stdout + proc.stderr
    # A full run is still refused a warm-up it cannot finish.
    if experiment == "gpt_char":
        long = run_cli([*args[:1], *data, "trainer.max_steps=50", "hydra.run.dir=long"])
        assert long.returncode == 2 and "warmup_steps=100 is not below" in long.stderr
        assert "Traceback" not in long.stderr


TINY_GPT = [
    "model=gpt",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=16",
    "model.block_size=16",
    "dataset.windows_per_epoch=32",
    "dataset.eval_windows=8",
    "loader.batch_size=8",
    "trainer.max_epochs=1",
    "trainer.progress=none",
]


def test_the_gpt_on_a_token_folder_is_a_language_model(run_cli, tmp_path):
    """dataset=tokens picks task=language_model; a task that cannot read token windows, asked
    for by name, is one paragraph naming the fix."""
    data = _tokens(tmp_path, run_cli)
    proc = run_cli([*TINY_GPT, "dataset=tokens", *data, "hydra.run.dir=run"])
    check_ok(proc)
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["monitor"] == "val/loss" and summary["best_val_loss"] > 0
    for task in ("classification", "regression"):
        args = [*TINY_GPT, "dataset=tokens", *data, f"task={task}", f"hydra.run.dir={task}"]
        refused = run_cli(args)
        assert refused.returncode == 2, refused.stderr
        assert "`task=language_model`" in refused.stderr and "Traceback" not in refused.stderr
        assert not (tmp_path / task).exists()  # a refused run leaves no run dir behind
