"""Exact resume on the CPU (end of epoch and mid-epoch), a kill -9 during training, and resumes
at another data-parallel width."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from helpers import BIN, FAST, assert_same_weights, check_ok, read_jsonl

from accel_train.checkpoint import load_checkpoint

# Dropout (mlp has 0.1), random shifts, accumulation, a stepped lr: every piece of state that a
# resume must restore is in play. 256 samples / 32 per batch = 8 micro-batches = 4 steps/epoch.
EXACT = [
    *FAST,
    "model.dropout=0.3",
    "dataset.random_shift=2",
    "loader.batch_size=32",
    "trainer.accumulate_grad_batches=2",
    "scheduler=step",
    "scheduler.step_size=3",
    "optimizer=adamw",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "logger=none",
]
STEPS_PER_EPOCH = 4


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, run_cli_in):
    """The uninterrupted 2-epoch run."""
    cwd = tmp_path_factory.mktemp("reference")
    run_dir = cwd / "run"
    check_ok(run_cli_in([*EXACT, "trainer.max_epochs=2", f"hydra.run.dir={run_dir}"], cwd))
    return run_dir


def _progress(run_dir):
    return load_checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]


def test_resume_after_an_epoch_is_exact(reference_run, run_cli, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    check_ok(run_cli([*EXACT, "trainer.max_epochs=1", f"hydra.run.dir={first}"]))
    assert _progress(first)["step"] == STEPS_PER_EPOCH
    last = first / "checkpoints" / "last.pt"
    proc = run_cli([*EXACT, "trainer.max_epochs=2", f"resume={last}", f"hydra.run.dir={second}"])
    check_ok(proc)
    assert f"resumed from {last}" in proc.stdout + proc.stderr
    assert _progress(second) == _progress(reference_run)
    assert_same_weights(
        second / "checkpoints" / "last.pt", reference_run / "checkpoints" / "last.pt"
    )
    # The resumed run logs only the steps it trained, with the same losses as the reference.
    ref = {
        m["step"]: m["train/loss"]
        for m in read_jsonl(reference_run / "metrics.jsonl")
        if "train/loss" in m
    }
    resumed = {
        m["step"]: m["train/loss"]
        for m in read_jsonl(second / "metrics.jsonl")
        if "train/loss" in m
    }
    assert sorted(resumed) == list(range(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH + 1))
    assert all(resumed[s] == ref[s] for s in resumed)


def test_resume_mid_epoch_is_exact(reference_run, run_cli, tmp_path):
    """Stop at step 3 of 4 (checkpointing every 2 steps), then `resume=auto` in the same run dir
    continues with the next batch, not from the start of the epoch."""
    run_dir = tmp_path / "run"
    common = [*EXACT, "trainer.max_epochs=2", f"hydra.run.dir={run_dir}"]
    # resume=auto with no checkpoint yet is a fresh start.
    first = [*common, "trainer.max_steps=3", "trainer.ckpt_every_n_steps=2", "resume=auto"]
    check_ok(run_cli(first))
    assert not [m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("event") == "resume"]
    progress = _progress(run_dir)
    assert (progress["epoch"], progress["step"], progress["batch_in_epoch"]) == (0, 3, 6)

    proc = run_cli([*common, "resume=auto"])
    check_ok(proc)
    # (best_val_acc may differ: the interrupted run also validated at step 3.)
    keys = ("epoch", "step", "batch_in_epoch", "last_val")
    resumed, reference = _progress(run_dir), _progress(reference_run)
    assert [resumed[k] for k in keys] == [reference[k] for k in keys]
    assert_same_weights(
        run_dir / "checkpoints" / "last.pt", reference_run / "checkpoints" / "last.pt"
    )
    # metrics.jsonl is appended to: one resume event, then steps 4.. of the same run.
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics if m.get("event") == "resume"] == [3]
    steps = [m["step"] for m in metrics if "train/loss" in m]
    assert steps == list(range(1, 2 * STEPS_PER_EPOCH + 1))


def test_kill_9_leaves_a_loadable_checkpoint_and_resume_is_exact(run_cli, tmp_path):
    """SIGKILL while last.pt is rewritten after every step; the file that is left loads, a stray
    temp file does not disturb `resume=auto`, and the resumed run equals an uninterrupted one."""
    run_dir = tmp_path / "killed"
    base = [
        *EXACT,
        "dataset.num_train=2048",  # 1,843 after the 10% held out: 29 steps per epoch
        "trainer.max_epochs=50",
        "trainer.ckpt_every_n_steps=1",
        "trainer.log_every_n_steps=1000",
    ]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["ACCEL_TRAIN_DATA_DIR"] = str(tmp_path / "no-data-here")
    last = run_dir / "checkpoints" / "last.pt"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "accel-train"), *base, f"hydra.run.dir={run_dir}"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 120
            while not last.exists():
                assert proc.poll() is None, (tmp_path / "killed.log").read_text()
                assert time.monotonic() < deadline, "no last.pt after 120 s"
                time.sleep(0.05)
            first_mtime = last.stat().st_mtime_ns
            while last.stat().st_mtime_ns == first_mtime:  # it keeps being rewritten
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.3)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    state = load_checkpoint(last)
    step = state["progress"]["step"]
    assert step >= 2
    p = state["progress"]
    assert step == p["epoch"] * 32 + p["batch_in_epoch"] // 2  # 2 micro-batches per step
    assert not (run_dir / "summary.json").exists()

    # A leftover temp file from an interrupted save (the kill may or may not have left one).
    (run_dir / "checkpoints" / ".last.pt.tmp-99999").write_bytes(b"torn half of a save")
    target = step + 3
    proc = run_cli(
        [*base, "resume=auto", f"trainer.max_steps={target}", f"hydra.run.dir={run_dir}"]
    )
    check_ok(proc)
    assert load_checkpoint(last)["progress"]["step"] == target

    reference = tmp_path / "reference"
    check_ok(run_cli([*base, f"trainer.max_steps={target}", f"hydra.run.dir={reference}"]))
    assert_same_weights(last, reference / "checkpoints" / "last.pt")


# 256 samples, all of them training (val_fraction=0), 32 per batch: 8 optimizer steps an epoch
# on one process, 4 on two (DDP).
WIDTH = [*FAST, "dataset.val_fraction=0", "loader.batch_size=32", "logger=none"]
TWO = ["strategy=ddp", "launcher.nproc_per_node=2"]


def test_resume_at_another_width_counts_the_steps_done(run_cli, tmp_path):
    """A run resumed at an epoch boundary with more or fewer data-parallel processes keeps the
    steps it did and trains the epochs still to run at the new steps per epoch; max_steps counts
    optimizer steps of the whole run. One run dir, resumed four times, alternating widths:
    (1 process) 1 epoch = 8 steps; (2) to max_epochs=2: +4 = 12; (1) to max_epochs=3: +8 = 20;
    (2) to max_steps=24: +4; (1) to max_steps=28: +4, mid-epoch."""
    run_dir = tmp_path / "run"
    common = [*WIDTH, f"hydra.run.dir={run_dir}", "resume=auto"]
    chain = [
        (["trainer.max_epochs=1"], (8, 1), None),
        ([*TWO, "trainer.max_epochs=2"], (12, 2), "the 1 epoch(s) still to run are 4 more"),
        (["trainer.max_epochs=3"], (20, 3), "the 1 epoch(s) still to run are 8 more"),
        (
            [*TWO, "trainer.max_epochs=-1", "trainer.max_steps=24"],
            (24, 4),
            "trainer.max_steps=24 counts optimizer steps of the whole run, whatever their "
            "global batch: 4 more",
        ),
        (
            ["trainer.max_epochs=-1", "trainer.max_steps=28"],
            (28, 4),
            "trainer.max_steps=28 counts optimizer steps of the whole run, whatever their "
            "global batch: 4 more",
        ),
    ]
    for args, (steps, epochs), said in chain:
        proc = run_cli([*common, *args])
        check_ok(proc)
        output = proc.stdout + proc.stderr
        assert "already finished" not in output, output[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert (summary["steps"], summary["epochs"]) == (steps, epochs), (args, output[-3000:])
        if said:
            assert said in output, output[-3000:]
            # The lr schedule is rebuilt for the run's real length.
            assert f"lr schedule for {steps} steps" in output, output[-3000:]
