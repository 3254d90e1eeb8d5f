"""The real `accel-train` / `accel-eval` console scripts end to end, in subprocesses.

Two runs are shared by the tests of this module:
- synthetic: the default data set, csv logger, `+debug=profile`, run dir set by `hydra.run.dir`;
- mnist: `+experiment=mnist_amp` (small_cnn, amp, device loader, OneCycle)
  on the tiny IDX MNIST, TensorBoard logger, run dir chosen by Hydra's default pattern.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
from helpers import FAST, MNIST_TEST, check_ok, read_jsonl
from omegaconf import OmegaConf

from accel_train.checkpoint import load_checkpoint
from accel_train.config.run_config import load_run_config
from accel_train.precision import cpu_has_fast_bf16

SUMMARY_KEYS = {"best_val_acc", "final_val_acc", "epochs", "steps", "train_samples_per_s", "wall_s"}


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory, run_cli_in):
    cwd = tmp_path_factory.mktemp("synthetic")
    run_dir = cwd / "run"
    args = [
        *FAST,
        "+debug=profile",  # 10 training batches per epoch, trace of steps 2-6
        "loader.batch_size=16",  # 256 / 16 = 16 batches per epoch, limited to 10
        "trainer.max_epochs=2",
        "trainer.limit_val_batches=0",
        f"hydra.run.dir={run_dir}",
    ]
    proc = run_cli_in(args, cwd)
    check_ok(proc)
    return run_dir, proc


@pytest.fixture(scope="module")
def mnist_run(tmp_path_factory, run_cli_in, mnist_dir):
    cwd = tmp_path_factory.mktemp("mnist")
    args = [
        "+experiment=mnist_amp",
        f"paths.data_dir={mnist_dir}",
        "trainer.max_epochs=3",
        "trainer.log_every_n_steps=2",
        "logger=tensorboard",
        "trainer.progress=none",
    ]
    proc = run_cli_in(args, cwd)
    check_ok(proc)
    # No hydra.run.dir: outputs/<experiment name>/<date>_<time with microseconds> under the cwd.
    run_dirs = list((cwd / "outputs" / "mnist_amp").iterdir())
    assert len(run_dirs) == 1, run_dirs
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}-\d{6}", run_dirs[0].name)
    return run_dirs[0], proc


def _check_run_dir(run_dir: Path, expected_epochs: int) -> dict:
    for name in ("config.yaml", "config_tree.txt", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).is_file(), name
    # The resolved config: no interpolations left, loadable against the schema, this run dir.
    text = (run_dir / "config.yaml").read_text()
    assert "${" not in text
    cfg = load_run_config(run_dir / "config.yaml")
    assert Path(cfg.paths.output_dir).resolve() == run_dir.resolve()
    tree = (run_dir / "config_tree.txt").read_text()
    assert "trainer" in tree and f"max_epochs: {cfg.trainer.max_epochs}" in tree

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train = [m for m in metrics if "train/loss" in m]
    val = [m for m in metrics if "val/acc" in m]
    assert train and val
    for m in train:
        assert {"step", "epoch", "train/lr", "train/samples_per_s"} <= m.keys()
        assert math.isfinite(m["train/loss"])
    assert all("val/loss" in m and 0 <= m["val/acc"] <= 1 for m in val)
    assert len(val) == expected_epochs
    steps = [m["step"] for m in train]
    assert steps == sorted(steps)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["epochs"] == expected_epochs
    assert summary["steps"] == max(m["step"] for m in metrics)
    assert summary["best_val_acc"] == max(m["val/acc"] for m in val)
    assert summary["final_val_acc"] == val[-1]["val/acc"]
    assert summary["train_samples_per_s"] > 0 and summary["wall_s"] > 0

    for name in ("last.pt", "best.pt"):
        ckpt = load_checkpoint(run_dir / "checkpoints" / name)
        assert {"model", "optimizer", "scaler", "progress", "rng", "config"} <= ckpt.keys()
        assert OmegaConf.create(ckpt["config"]) == OmegaConf.load(run_dir / "config.yaml")
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert last["progress"]["step"] == summary["steps"]
    assert last["progress"]["epoch"] == expected_epochs
    return summary


def test_synthetic_run_outputs(synthetic_run):
    run_dir, proc = synthetic_run
    summary = _check_run_dir(run_dir, expected_epochs=2)
    assert summary["steps"] == 20  # 10 batches (limit) x 2 epochs
    assert "Traceback" not in proc.stderr
    # The synthetic digits are learnable: 20 Adam steps of an MLP get far above chance.
    assert summary["best_val_acc"] > 0.5
    # Ten classes: top-5 accuracy is logged by default, as timm logs it (issue 47 F.29).
    assert summary["best_val_acc_top5"] >= summary["best_val_acc"]
    assert summary["test_acc_top5"] >= summary["test_acc"]


def test_csv_logger(synthetic_run):
    run_dir, _ = synthetic_run
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "epoch", "metric", "value"]
    metrics = {r[2] for r in rows[1:]}
    assert {"train/loss", "train/lr", "val/loss", "val/acc"} <= metrics
    assert all(math.isfinite(float(r[3])) for r in rows[1:])
    assert not (run_dir / "tensorboard").exists()


def test_profile_trace(synthetic_run):
    run_dir, _ = synthetic_run
    traces = list((run_dir / "profile").glob("*.pt.trace.json*"))
    assert traces, list((run_dir / "profile").iterdir())
    trace = json.loads(traces[0].read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("aten::") for n in names), "no operator events in the trace"
    steps = {n for n in names if n.startswith("ProfilerStep#")}
    assert len(steps) == 5  # trainer.profile_steps recorded steps


def test_mnist_run_outputs(mnist_run):
    run_dir, proc = mnist_run
    summary = _check_run_dir(run_dir, expected_epochs=3)
    cfg = load_run_config(run_dir / "config.yaml")
    assert (cfg.dataset.name, cfg.loader.name, cfg.precision.name) == ("mnist", "device", "amp")
    # amp resolves to bf16 on a CPU with bf16 instructions, else to fp32
    assert ("bfloat16 autocast" if cpu_has_fast_bf16() else "no native bf16") in summary[
        "precision"
    ]
    # 256 images less the 10% held out for validation (26, stratified) / 64 per batch, 3 epochs
    assert summary["steps"] == 3 * 4
    # Real data through the real torchvision loader: the tiny digits are learnable.
    assert summary["best_val_acc"] > 0.5


def test_tensorboard_logger(mnist_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = mnist_run
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "val/loss", "val/acc"} <= tags
    assert len(acc.Scalars("val/acc")) == 3
    assert not (run_dir / "metrics.csv").exists()


def test_eval_matches_the_runs_test_score(mnist_run, run_cli, tmp_path):
    run_dir, _ = mnist_run
    best = run_dir / "checkpoints" / "best.pt"
    proc = run_cli([f"ckpt_path={best}"], prog="accel-eval")
    check_ok(proc)
    out = run_dir / "eval_best.json"  # the default location: beside the run's checkpoints
    result = json.loads(out.read_text())
    assert result["split"] == "test" and result["dataset"] == "mnist"
    assert result["num_samples"] == MNIST_TEST

    step = load_checkpoint(best)["progress"]["step"]
    assert result["step"] == step
    logged = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "val/acc" in m]
    at_step = [m for m in logged if m["step"] == step]
    assert len(at_step) == 1 and at_step[0]["val/acc"] == max(m["val/acc"] for m in logged)
    # The run scored best.pt on the test split after training: accel-eval reproduces it.
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_ckpt"] == "best"
    assert result["test/acc"] == summary["test_acc"]
    assert result["test/loss"] == pytest.approx(summary["test_loss"], rel=1e-4)
    (tested,) = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "test/acc" in m]
    assert tested["test/acc"] == summary["test_acc"]
    # Nothing else is written: eval makes no Hydra run dir in its working directory.
    assert not (tmp_path / "outputs").exists() and not (tmp_path / ".hydra").exists()


def test_compile_channels_last_accumulation_clipping(run_cli, tmp_path):
    """The speed switches together in one real run: torch.compile (inductor on the CPU),
    channels_last, gradient accumulation and clipping, with the logged loss finite."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            *FAST,
            "model=mnist_cnn",
            "trainer.compile=true",
            "trainer.channels_last=true",
            "trainer.accumulate_grad_batches=2",
            "trainer.gradient_clip_val=1.0",
            "trainer.max_steps=3",
            "trainer.log_every_n_steps=1",
            "trainer.limit_val_batches=2",
            f"hydra.run.dir={run_dir}",
        ],
        timeout=600,
    )
    check_ok(proc)
    losses = [r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    out = proc.stdout + proc.stderr
    # torch.compile is lazy: the run says so, then how long the compiling first step took.
    assert "compiling the model (the first step takes longer)" in out
    assert re.search(r"compiled: the first step, compiling included, took \d+\.\d s", out)
    # train/grad_norm at every logging step: the norm clipping computed (before clipping).
    norms = [
        r["train/grad_norm"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r
    ]
    assert len(norms) == 3 and all(math.isfinite(x) and x > 0 for x in norms)


def test_the_fast_exit_stops_idle_thread_pools():
    """accel-train ends without the interpreter's teardown (environment.exit_without_teardown).
    An idle concurrent.futures pool (Inductor's compile workers after trainer.compile=true on a GPT)
    kept it waiting forever: its workers stop only when the threading module's exit hooks run,
    which the normal exit runs before it joins the threads."""
    import subprocess
    import sys

    code = (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from accel_train.environment import exit_without_teardown\n"
        "pool = ThreadPoolExecutor(2)\n"
        "assert pool.submit(lambda: 7).result() == 7\n"
        "print('done', flush=True)\n"
        "exit_without_teardown(0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
