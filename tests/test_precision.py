"""Every precision trains on the CPU with a finite loss (in-process, through `launch`)."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from helpers import FAST, read_jsonl

from accel_train.launchers.launch import launch
from accel_train.precision import cpu_has_fast_bf16

# amp on a CPU: bf16 autocast where the CPU has bf16 instructions, else fp32 (bf16 is emulated
# and several times slower there).
AMP_ON_CPU = "bfloat16 autocast" if cpu_has_fast_bf16() else "fp32 on cpu (no native bf16"

EXPECTED = {
    # name: (autocast dtype named in the description, parameter dtype, GradScaler)
    "fp32": ("fp32", torch.float32, False),
    "amp": (AMP_ON_CPU, torch.float32, False),
    "fp16": ("float16 autocast", torch.float32, True),
    "bf16": ("bfloat16 autocast", torch.float32, False),
    "bf16_true": ("weights and compute in bf16", torch.bfloat16, False),
}


@pytest.mark.parametrize("precision", sorted(EXPECTED))
def test_precision_trains_on_cpu(precision, compose_cfg, tmp_path, caplog):
    described, param_dtype, scaler = EXPECTED[precision]
    cfg = compose_cfg(
        [
            *FAST,
            "model=mnist_cnn",  # convolutions, pooling and linears under autocast
            "loader.batch_size=32",
            "+debug=fast_dev_run",
            "checkpoint.save_last=true",  # fast_dev_run keeps none; this test reads last.pt
            "trainer.limit_train_batches=3",
            f"precision={precision}",
            "logger=none",
            f"paths.output_dir={tmp_path}",
        ]
    )
    with caplog.at_level(logging.WARNING):
        best = launch(cfg)

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["precision"].startswith(precision) and described in summary["precision"]
    assert best == summary["best_val_acc"] and 0 <= best <= 1
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    val = [m for m in metrics if "val/loss" in m]
    assert val and all(math.isfinite(m["val/loss"]) for m in val)

    state = torch.load(tmp_path / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    weights = [t for t in state["model"].values() if t.is_floating_point()]
    assert weights and all(t.dtype == param_dtype for t in weights)
    assert all(torch.isfinite(t.float()).all() for t in weights)
    assert bool(state["scaler"]) == scaler  # a disabled GradScaler has an empty state

    fp16_warnings = [r for r in caplog.records if "precision=fp16 on the CPU" in r.getMessage()]
    assert len(fp16_warnings) == (1 if precision == "fp16" else 0)
