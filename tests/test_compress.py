"""Compression techniques on the technique layer, through the real CLI: knowledge distillation
(distill.*), magnitude pruning (prune.*) and selective backprop (selective_backprop.*)."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import check_ok, read_jsonl, run_cli

from accel_train.config.checks import validate
from accel_train.errors import UserError

# Tiny: an MLP with small hidden layers on 128 synthetic images (115 train / 13 val), batch 32.
TINY = [
    "model=mlp",
    "model.hidden_dims=[32,16]",
    "dataset.num_train=128",
    "dataset.num_test=32",
    "loader.batch_size=32",
    "trainer.progress=none",
    "trainer.log_every_n_steps=1",
]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A teacher checkpoint, trained by the CLI (wider MLP, 2 epochs)."""
    root = tmp_path_factory.mktemp("teacher")
    check_ok(
        run_cli(
            [*TINY, "model.hidden_dims=[64]", "trainer.max_epochs=2", "hydra.run.dir=run"], root
        )
    )
    return root / "run" / "checkpoints" / "best.pt"


# ---- distillation -------------------------------------------------------------------------


def test_distill_from_a_teacher_checkpoint(teacher, tmp_path):
    run_dir = tmp_path / "student"
    proc = run_cli(
        [
            *TINY,
            "trainer.max_epochs=1",
            f"distill.teacher={teacher}",
            "distill.alpha=0.3",
            "distill.temperature=2",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    check_ok(proc)
    sha = hashlib.sha256(teacher.read_bytes()).hexdigest()
    recorded = _summary(run_dir)["distill"]
    assert recorded == {
        "teacher": str(teacher.resolve()),
        "teacher_sha256": sha,
        "alpha": 0.3,
        "temperature": 2.0,
    }
    last = _ckpt(run_dir / "checkpoints" / "last.pt")
    assert last["techniques"]["distill"] == {"teacher": str(teacher.resolve()), "sha256": sha}
    # The student's checkpoint holds the student only (the teacher has a 64-wide layer).
    assert all(t.shape[0] != 64 for t in last["model"].values())
    soft = [r.get("distill/soft_loss") for r in read_jsonl(run_dir / "metrics.jsonl")]
    soft = [s for s in soft if s is not None]
    assert len(soft) == 4 and all(math.isfinite(s) and s > 0 for s in soft)


def test_distill_refuses_a_missing_teacher_and_one_of_other_classes(teacher, tmp_path, compose_cfg):
    # A missing file: the config checks (in-process; run by the CLI before anything else).
    cfg = compose_cfg([*TINY, "distill.teacher=nope/best.pt", f"paths.output_dir={tmp_path}"])
    with pytest.raises(UserError, match=r"distill.teacher='nope/best.pt': no such checkpoint"):
        validate(cfg)
    # A teacher of another task: found when it is loaded, through the CLI.
    proc = run_cli(
        [*TINY, f"distill.teacher={teacher}", "dataset.num_classes=5", "hydra.run.dir=b"],
        tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "the teacher was trained on 10 classes, the student on 5" in proc.stderr


# ---- pruning ------------------------------------------------------------------------------

PRUNE = [
    *TINY,
    "model.dropout=0",
    "trainer.deterministic=true",
    "prune.amount=0.5",
    # Absolute steps (> 1), so the schedule does not depend on the run's length: 4 steps per
    # epoch, masks updated at steps 2 (sparsity 0), 4 and 6 (final).
    "prune.schedule.start=2",
    "prune.schedule.end=6",
    "prune.schedule.every_n_steps=2",
]


def test_prune_to_half_and_resume_mid_schedule_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    check_ok(run_cli([*PRUNE, "trainer.max_epochs=2", f"hydra.run.dir={straight}"], tmp_path))
    # The same run stopped after epoch 1 (step 4: between the schedule's mask updates), resumed.
    check_ok(run_cli([*PRUNE, "trainer.max_epochs=1", f"hydra.run.dir={resumed}"], tmp_path))
    mid = _ckpt(resumed / "checkpoints" / "last.pt")
    mid_masks = mid["techniques"]["prune"]["masks"]
    assert (
        0
        < sum(int((~m).sum()) for m in mid_masks.values())
        < 0.5 * sum(m.numel() for m in mid_masks.values())
    )
    check_ok(
        run_cli(
            [*PRUNE, "trainer.max_epochs=2", "resume=auto", f"hydra.run.dir={resumed}"], tmp_path
        )
    )
    a, b = _ckpt(straight / "checkpoints" / "last.pt"), _ckpt(resumed / "checkpoints" / "last.pt")
    # Plain weights (no weight_orig / weight_mask): loadable by any model and by accel-eval.
    assert not any(k.endswith(("_orig", "_mask")) for k in a["model"])
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    masks_a, masks_b = a["techniques"]["prune"]["masks"], b["techniques"]["prune"]["masks"]
    assert masks_a.keys() == masks_b.keys() == {"1", "4"}  # the output layer "7" stays dense
    assert all(torch.equal(masks_a[k], masks_b[k]) for k in masks_a)
    total = sum(m.numel() for m in masks_a.values())
    assert sum(int((~m).sum()) for m in masks_a.values()) == round(0.5 * total)
    for name, mask in masks_a.items():  # the weights are zero exactly where masked
        assert torch.equal(a["model"][f"{name}.weight"] != 0, mask)
    assert _summary(straight)["prune"]["sparsity"] == pytest.approx(0.5, abs=1e-4)
    logged = [r.get("prune/sparsity") for r in read_jsonl(straight / "metrics.jsonl")]
    logged = [s for s in logged if s is not None]
    assert logged == sorted(logged) and logged[-1] == pytest.approx(0.5, abs=1e-4)
    assert logged[0] == 0.0


def test_structured_pruning_zeroes_whole_channels_and_evaluates(tmp_path):
    run_dir = tmp_path / "run"
    check_ok(
        run_cli(
            [
                *TINY,
                "trainer.max_epochs=1",
                "prune.amount=0.5",
                "prune.method=structured",
                "prune.scope=layer",
                "prune.schedule.end=0.5",
                "prune.schedule.every_n_steps=1",
                f"hydra.run.dir={run_dir}",
            ],
            tmp_path,
        )
    )
    weights = _ckpt(run_dir / "checkpoints" / "best.pt")["model"]
    for name, rows in (("1.weight", 32), ("4.weight", 16)):
        zero_rows = int((weights[name].abs().sum(dim=1) == 0).sum())
        assert zero_rows == rows // 2, name  # half the neurons, shape unchanged
        assert weights[name].shape[0] == rows
    proc = run_cli([f"ckpt_path={run_dir}/checkpoints/best.pt"], tmp_path, prog="accel-eval")
    check_ok(proc)
    assert "test/acc=" in proc.stderr + proc.stdout


def test_prune_refusals(tmp_path, compose_cfg):
    """Config checks (in-process: config/checks.py validate, which the CLI runs first)."""
    for args, expected in (
        (["prune.method=structured"], "prune.method=structured with prune.scope=global"),
        (["strategy=fsdp"], "prune with strategy=fsdp is not supported"),
    ):
        cfg = compose_cfg([*TINY, "prune.amount=0.5", *args, f"paths.output_dir={tmp_path}"])
        with pytest.raises(UserError) as refused:
            validate(cfg)
        assert expected in str(refused.value)


# ---- selective backprop -------------------------------------------------------------------

LOSS = """
import torch


class NoReduction(torch.nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()

    def forward(self, logits, targets):
        return torch.nn.functional.cross_entropy(logits, targets)
"""


def test_selective_backprop_keeps_the_hardest_quarter(tmp_path):
    run_dir = tmp_path / "run"
    check_ok(
        run_cli(
            [
                *TINY,
                "loader.drop_last=true",  # 115 train -> 3 full batches of 32 per epoch
                "trainer.max_epochs=2",
                "selective_backprop.keep=0.25",
                "selective_backprop.start=0",
                "selective_backprop.end=1",
                "selective_backprop.interrupt=3",
                f"hydra.run.dir={run_dir}",
            ],
            tmp_path,
        )
    )
    # 6 optimizer steps; steps 3 and 6 (multiples of interrupt=3) take the full batch.
    sb = _summary(run_dir)["selective_backprop"]
    assert sb == {"keep": 0.25, "selected_batches": 4, "kept_samples": 4 * 8, "seen_samples": 128}
    fractions = [
        r.get("selective_backprop/kept_fraction") for r in read_jsonl(run_dir / "metrics.jsonl")
    ]
    assert [f for f in fractions if f is not None][-1] == 0.25


def test_selective_backprop_refuses_a_loss_without_reduction(tmp_path):
    (tmp_path / "myloss.py").write_text(LOSS)
    proc = run_cli(
        [
            *TINY,
            "loss=custom",
            "loss._target_=myloss.NoReduction",
            "selective_backprop.keep=0.5",
            "hydra.run.dir=r",
        ],
        tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "loss._target_=myloss.NoReduction takes no `reduction` argument" in proc.stderr
    assert not (tmp_path / "r" / "checkpoints").exists()


# ---- all three under DDP --------------------------------------------------------------------


def test_all_three_under_ddp(teacher, tmp_path):
    run_dir = tmp_path / "run"
    check_ok(
        run_cli(
            [
                *TINY,
                "trainer.max_epochs=2",
                "strategy=ddp",
                "launcher.nproc_per_node=2",
                f"distill.teacher={teacher}",
                "prune.amount=0.5",
                "prune.schedule.every_n_steps=1",
                "selective_backprop.keep=0.5",
                "selective_backprop.start=0",
                f"hydra.run.dir={run_dir}",
            ],
            tmp_path,
            timeout=300,
        )
    )
    summary = _summary(run_dir)
    assert summary["world_size"] == 2
    assert summary["prune"]["sparsity"] == pytest.approx(0.5, abs=1e-4)
    assert summary["selective_backprop"]["selected_batches"] > 0
    assert summary["distill"]["teacher"] == str(teacher.resolve())
