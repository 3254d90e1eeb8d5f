"""The `checkpoint` group (Lightning's ModelCheckpoint keys): top-k files named by a pattern,
best.pt by the monitored metric, the bookkeeping surviving a resume, fast_dev_run keeping
nothing, a bad monitor refused before anything trains."""

from __future__ import annotations

import json
import re

import pytest
from helpers import FAST, check_ok, read_jsonl
from omegaconf import OmegaConf

from accel_train.errors import UserError
from accel_train.train.checkpointing import check

BASE = [*FAST, "dataset.num_train=320", "trainer.log_every_n_steps=2", "optimizer.lr=0.003"]
PATTERN = "epoch{epoch}-step{step}-loss{val/loss:.4f}"


def _kept(ckpts):
    return sorted(p.name for p in ckpts.iterdir() if p.name not in ("best.pt", "last.pt"))


def _expected_top2(rows):
    vals = [r for r in rows if "val/loss" in r]
    # Equal scores: the earlier file stays ahead (Lightning's strict comparison).
    top = sorted(vals, key=lambda r: r["val/loss"])[:2]
    # epoch in the name: the 0-based epoch the weights were trained in.
    return sorted(f"epoch{r['epoch'] - 1}-step{r['step']}-loss{r['val/loss']:.4f}.pt" for r in top)


def test_top_k_by_val_loss_named_and_kept_across_resume(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    args = [
        *BASE,
        "checkpoint.monitor=val/loss",
        "checkpoint.mode=min",
        "checkpoint.save_top_k=2",
        f"checkpoint.filename='{PATTERN}'",
        f"hydra.run.dir={run_dir}",
    ]
    check_ok(run_cli([*args, "trainer.max_epochs=3"]))
    ckpts = run_dir / "checkpoints"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert _kept(ckpts) == _expected_top2(rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    best_loss = min(r["val/loss"] for r in rows if "val/loss" in r)
    assert summary["monitor"] == "val/loss" and summary["best_score"] == best_loss
    best_file = next(p for p in ckpts.iterdir() if f"loss{best_loss:.4f}" in p.name)
    assert (ckpts / "best.pt").stat().st_ino == best_file.stat().st_ino  # a link, not a copy

    # Two more epochs: the ranking continues against the first run's files and best value.
    check_ok(run_cli([*args, "trainer.max_epochs=5", "resume=auto"]))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len([r for r in rows if "val/loss" in r]) == 5
    assert _kept(ckpts) == _expected_top2(rows)
    best_loss = min(r["val/loss"] for r in rows if "val/loss" in r)
    best_file = next(p for p in ckpts.iterdir() if f"loss{best_loss:.4f}" in p.name)
    assert (ckpts / "best.pt").stat().st_ino == best_file.stat().st_ino
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_score"] == best_loss


def test_fast_dev_run_keeps_no_checkpoints_and_tests_final_weights(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    check_ok(run_cli([*FAST, "+debug=fast_dev_run", f"hydra.run.dir={run_dir}"]))
    ckpts = run_dir / "checkpoints"
    assert not ckpts.exists() or not list(ckpts.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_ckpt"] == "last"  # the final weights, in memory


def test_unknown_monitor_refused_at_start(run_cli, tmp_path):
    proc = run_cli([*FAST, "checkpoint.monitor=val/accuracy", f"hydra.run.dir={tmp_path / 'r'}"])
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "checkpoint.monitor=val/accuracy" in proc.stderr
    assert re.search(r"known ones: val/loss, val/acc", proc.stderr), proc.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.parametrize(
    ("filename", "message"),
    [
        ("x{foo}", "has the field {foo}; the fields it may use are {epoch}, {step}, {val/loss}"),
        ("a/b{step}", "e.g. 'epoch{epoch}-step{step}-val_ppl{val/ppl:.4f}'"),
        ("e{val/loss:.4q}", "use e.g. {val/ppl:.4f} or {epoch:03d}"),
    ],
)
def test_a_bad_filename_pattern_is_refused_with_the_runs_own_metric(filename, message):
    """A language model monitoring val/ppl is shown its own metric, not a classifier's."""
    cfg = OmegaConf.create(
        {"monitor": "val/ppl", "mode": "min", "save_top_k": 1, "every_n_epochs": 1}
    )
    cfg.filename = filename
    with pytest.raises(UserError) as err:
        check(cfg, ["val/loss", "val/ppl"])
    assert message in str(err.value)
