"""Always-on speed metrics (techniques/speed.py), validation inside an epoch
(trainer.val_check_interval), fractional batch limits, and finishing early
(techniques/early_stopping.py: early_stopping.*, trainer.stop_at), through the real CLI on tiny
runs; the config refusals in-process."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import FAST, check_ok, read_jsonl

from accel_train.config.checks import validate
from accel_train.errors import UserError

# 1024 samples, 10% held out: 921 train / 64 per batch = 15 steps per epoch.
BASE = [
    *FAST,
    "dataset.num_train=1024",
    "trainer.log_every_n_steps=5",
    "logger=csv",
    "trainer.deterministic=true",
]


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _validation_steps(run_dir) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "val/acc" in r]


def test_speed_metrics_are_logged_and_summarised(run_cli, tmp_path):
    """Every logging step has samples/s, step time, data-wait share, peak memory and achieved
    FLOP/s; FLOPs per sample are the model's (3 x 2 x the MLP's multiply-adds); no MFU on a
    CPU unless trainer.peak_flops is given, then achieved / peak."""
    run_dir = tmp_path / "run"
    args = [*BASE, "trainer.max_epochs=1", "trainer.peak_flops=1e12", f"hydra.run.dir={run_dir}"]
    check_ok(run_cli(args))
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [5, 10, 15]
    for row in rows:
        assert row["train/samples_per_s"] > 0 and row["train/step_s"] > 0
        assert 0 <= row["train/data_wait_share"] < 1
        assert row["train/peak_mem_mb"] > 50  # a Python process with torch loaded
        assert row["train/mfu"] == pytest.approx(row["train/tflops"] * 1e12 / 1e12)
    summary = _summary(run_dir)
    weights = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    macs = sum(w.numel() for k, w in weights.items() if k.endswith("weight"))
    assert summary["flops_per_sample"] == 3 * 2 * macs
    steady = [r["train/samples_per_s"] for r in rows[1:]]  # the first interval is warm-up
    assert min(steady) <= summary["samples_per_s"] <= max(steady)
    assert summary["warmup_s"] > 0 and 0 <= summary["data_wait_share"] < 1
    assert 0 < summary["train_cpu_s_per_sample"] < 1  # the process's own CPU, steady intervals
    assert summary["mfu"] == pytest.approx(summary["tflops"])


def test_validation_inside_epochs_and_fractional_limits(run_cli, tmp_path):
    """val_check_interval=0.25 of a 15-step epoch limited to half its batches (7 steps):
    validations every 2 steps and at the epoch's end; an int interval counts optimizer steps."""
    by_fraction, by_steps = tmp_path / "fraction", tmp_path / "steps"
    check_ok(
        run_cli(
            [
                *BASE,
                "trainer.max_epochs=2",
                "trainer.limit_train_batches=0.5",
                "trainer.val_check_interval=0.25",
                f"hydra.run.dir={by_fraction}",
            ]
        )
    )
    assert _validation_steps(by_fraction) == [2, 4, 6, 7, 9, 11, 13, 14]
    check_ok(
        run_cli(
            [
                *BASE,
                "trainer.max_epochs=2",
                "trainer.val_check_interval=4",
                f"hydra.run.dir={by_steps}",
            ]
        )
    )
    assert _validation_steps(by_steps) == [4, 8, 12, 15, 16, 20, 24, 28, 30]


def test_stop_at_a_target_records_time_and_steps_and_stays_finished(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    args = [
        *BASE,
        "trainer.max_epochs=5",
        "trainer.val_check_interval=0.2",
        "trainer.stop_at='val/acc>=0.5'",
        f"hydra.run.dir={run_dir}",
    ]
    proc = run_cli(args)
    check_ok(proc)
    summary = _summary(run_dir)
    steps = summary["steps_to_target"]
    assert summary["steps"] == steps < 75 and summary["time_to_target_s"] > 0
    assert summary["finished_early"].startswith("target val/acc>=0.5 reached")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    first = next(r for r in rows if r.get("val/acc", 0) >= 0.5)
    assert first["step"] == steps  # the first validation that reached it
    assert "test/acc" in rows[-1] and "finished early: target" in proc.stdout + proc.stderr
    again = run_cli([*args, "resume=auto"])
    check_ok(again)
    assert "already finished" in again.stdout + again.stderr
    assert _summary(run_dir) == summary


def test_a_target_is_recorded_while_training_goes_on(run_cli, tmp_path):
    """trainer.target records time and steps to the target like stop_at, and trains on; the
    limit_test_batches=2 scores two test batches."""
    run_dir = tmp_path / "run"
    args = [
        *BASE,
        "trainer.max_epochs=2",
        "trainer.val_check_interval=0.5",
        "trainer.target='val/acc>=0.5'",
        "trainer.limit_test_batches=2",
        "loader.eval_batch_size=5",
        f"hydra.run.dir={run_dir}",
    ]
    proc = run_cli(args)
    check_ok(proc)
    summary = _summary(run_dir)
    assert summary["target"] == "val/acc>=0.5" and summary["finished_early"] is None
    first = next(r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("val/acc", 0) >= 0.5)
    assert summary["steps_to_target"] == first["step"] < summary["steps"] == 30
    assert summary["time_to_target_s"] > 0
    assert "trainer.target: training goes on" in proc.stdout + proc.stderr
    # 2 test batches of 5: a multiple of 0.1 (all 64 test samples would give one of 1/64)
    assert summary["test_acc"] * 10 == pytest.approx(round(summary["test_acc"] * 10))


def test_early_stopping_after_patience_validations_without_improvement(run_cli, tmp_path):
    """An lr too small to move val/loss by min_delta: stops after `patience` validations past
    the first."""
    run_dir = tmp_path / "run"
    check_ok(
        run_cli(
            [
                *BASE,
                "trainer.max_epochs=10",
                "optimizer.lr=1e-9",
                "early_stopping.monitor=val/loss",
                "early_stopping.mode=min",
                "early_stopping.patience=2",
                "early_stopping.min_delta=0.01",
                f"hydra.run.dir={run_dir}",
            ]
        )
    )
    assert _validation_steps(run_dir) == [15, 30, 45]
    summary = _summary(run_dir)
    assert summary["early_stopped_at_step"] == 45 and summary["steps"] == 45
    assert "val/loss has not improved" in summary["finished_early"]


def test_a_bad_target_is_one_paragraph_naming_the_key(run_cli):
    proc = run_cli([*BASE, "trainer.stop_at='val/f1>=0.9'"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "trainer.stop_at='val/f1>=0.9' watches 'val/f1'" in proc.stderr
    assert "val/acc, val/loss" in proc.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.stop_at=val/acc"], "is not METRIC OP VALUE"),
        (["trainer.target=val/acc"], "trainer.target='val/acc' is not METRIC OP VALUE"),
        (
            ["trainer.stop_at='val/acc>=0.9'", "trainer.target='val/acc>=0.5'"],
            "trainer.stop_at='val/acc>=0.9' and trainer.target='val/acc>=0.5' differ",
        ),
        (["trainer.limit_test_batches=-2"], "trainer.limit_test_batches=-2 must be"),
        (["trainer.val_check_interval=1.5"], "trainer.val_check_interval=1.5 must be"),
        (["trainer.val_check_interval=0"], "trainer.val_check_interval=0 must be"),
        (["trainer.limit_train_batches=2.5"], "trainer.limit_train_batches=2.5 must be"),
        (["trainer.limit_val_batches=-1"], "trainer.limit_val_batches=-1 must be"),
        (["early_stopping.monitor=train/loss"], "is not a validation metric"),
        (["early_stopping.monitor=val/loss"], "Set `early_stopping.mode=min`"),
    ],
)
def test_loop_interval_refusals(compose_cfg, overrides, message, tmp_path):
    cfg = compose_cfg([*overrides, f"paths.output_dir={tmp_path}"])
    with pytest.raises(UserError, match=re.escape(message)):
        validate(cfg)
