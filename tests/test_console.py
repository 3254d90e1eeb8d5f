"""What a user sees: train/loss and train/acc from the first epoch with the default cadence, a
short start-up config (the whole tree in config_tree.txt), the end-of-run table, curves.png, a
profiler without kineto's GPU error on a CPU machine; under torchrun rank 0's output in
train.log and no DDP grad-stride warning."""

from __future__ import annotations

import re

from helpers import FAST, check_ok, read_jsonl


def test_default_cadence_logs_train_loss_and_acc_in_epoch_0(run_cli, tmp_path):
    # A run dir longer than a console's 80 columns: its path is never folded (issue 47).
    run_dir = tmp_path / ("run_" + "x" * 80)
    # 1100 images: ~15 steps an epoch, fewer than the old fixed 50.
    proc = run_cli(
        [
            *FAST,
            "dataset.num_train=1100",
            "trainer.max_epochs=2",
            "trainer.progress=plain",
            "trainer.profile=true",
            "trainer.profile_steps=2",
            "trainer.plot_curves=true",
            f"hydra.run.dir={run_dir}",
        ]
    )
    check_ok(proc)
    # A CPU trace on a CUDA build of torch without a driver: no kineto GPU error.
    assert list((run_dir / "profile").glob("*.pt.trace.json*"))
    assert "gpuGetDeviceCount" not in proc.stdout + proc.stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    assert [r for r in train if r["epoch"] == 0], rows
    assert len(train) >= 4  # a few points an epoch, not one in the run
    assert all(0.0 <= r["train/acc"] <= 1.0 for r in train)
    csv = (run_dir / "metrics.csv").read_text()
    assert ",train/loss," in csv and ",train/acc," in csv

    out = proc.stdout + proc.stderr
    # The start-up tree: chosen options and changed values; every key only in the file.
    assert "model=mlp" in out and "dataset.num_train: 1100 (default 2048)" in out
    assert "tune_malloc" not in out.split("run dir:")[0]
    assert "tune_malloc: True" in (run_dir / "config_tree.txt").read_text()
    # The config line names config_tree.txt on one line, however long (stdout is no terminal).
    assert f"config (all keys: {run_dir / 'config_tree.txt'})" in proc.stdout
    # Without a terminal, the training lines carry `epoch k/N step s/T` and the ETA, and the
    # validation lines number epochs as they do.
    lines = out.splitlines()
    trained = [line for line in lines if "[accel_train]" in line and " loss=" in line]
    assert trained and all(
        re.search(r"epoch [12]/2 step \d+/\d+  .* ETA \d+:\d\d:\d\d$", line) for line in trained
    ), trained
    assert any("epoch 1/2 step" in line and "val/acc=" in line for line in lines)
    assert any("epoch 2/2 step" in line and "val/acc=" in line for line in lines)
    assert "epoch 3/2" not in out
    # The parameter count splits trainable and frozen parameters.
    assert re.search(r"model mlp \([\d,]+ parameters, all trainable\)", out)
    assert "run summary" in proc.stdout and "best.pt val/acc" in proc.stdout
    done = [line for line in out.splitlines() if "done:" in line]
    assert done and all(line.split("]")[0].startswith("[") for line in done)
    assert (run_dir / "curves.png").is_file()  # matplotlib is a core dependency: every run


def test_ddp_rank0_output_in_train_log_and_no_grad_stride_warning(run_cli, tmp_path):
    """mnist_amp's setting (CNN, device loader, random shift) under 2-process DDP."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "model=mnist_cnn",
            "dataset.num_train=256",
            "dataset.num_test=64",
            "loader=device",
            "precision=amp",
            "dataset.random_shift=2",
            "strategy=ddp",
            "launcher=torchrun",
            "launcher.nproc_per_node=2",
            "trainer.max_steps=3",
            "trainer.log_every_n_steps=1",
            "trainer.progress=plain",
            f"hydra.run.dir={run_dir}",
        ]
    )
    check_ok(proc)
    assert "Grad strides" not in proc.stdout + proc.stderr
    log = (run_dir / "train.log").read_text()
    assert "torchrun" in log  # the launcher's lines
    assert "[rank 0]" in log and "val/acc=" in log and "done:" in log  # and rank 0's
    assert "[rank 1]" not in log
    # Rank 0's summary table comes after its log lines (it is written to the stream they go to,
    # which torchrun captures apart from stdout).
    assert proc.stderr.index("done:") < proc.stderr.index("run summary")
