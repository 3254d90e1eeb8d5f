"""Resume never silently changes the experiment (train/resume.py): refused keys, applied and
logged changes, the lr schedule of a longer run, a finished run, the best checkpoint carried into
a new run dir, and metrics without duplicate steps after a kill. The rules themselves are tested
in-process; the behaviour through the real CLI, on tiny runs (4 optimizer steps per epoch)."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import FAST, assert_same_weights, check_ok, read_jsonl
from omegaconf import OmegaConf

from accel_train.checkpoint import load_checkpoint
from accel_train.errors import UserError
from accel_train.loggers import MetricsLogger
from accel_train.optim import build_scheduler
from accel_train.train.checkpointing import link_or_copy as _link_or_copy
from accel_train.train.resume_rules import config_changes, refusal_reason

# 256 samples, 10% held out: 230 / 64 per batch = 4 steps per epoch; every step logged.
BASE = [*FAST, "trainer.deterministic=true", "trainer.log_every_n_steps=1", "logger=csv"]
STEPS_PER_EPOCH = 4
# Checkpoints at steps 3 and 6 (and 4, the end of epoch 0): a kill at step 8 loses step 7.
# Validations at steps 3 and 6 too (and at each epoch's end): a checkpoint step validates.
COSINE = [
    *BASE,
    "scheduler=cosine",
    "trainer.ckpt_every_n_steps=3",
    "trainer.val_check_interval=3",
]
ONECYCLE = [*BASE, "scheduler=onecycle"]
LR = 0.001  # optimizer=adam's default

KILLER = '''
import os
import signal

from accel_train.techniques import Technique


class KillAt(Technique):
    """SIGKILL this process when the loop reaches `step` (before that step is logged), or,
    with at=validation, when that step's validation starts."""

    def __init__(self, step, at="step"):
        self.step, self.at = step, at

    def on_train_step_end(self, loop):
        if self.at == "step" and loop.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_validation_start(self, loop):
        if self.at == "validation" and loop.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
'''


# ---- helpers ------------------------------------------------------------------------------


def _snapshot(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of a run dir (bytes and mtime) but what every start writes before a resume is
    checked: Hydra's .hydra/ and train.log, and the run-dir lock's holder line (.lock)."""
    return {
        str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.relative_to(run_dir).parts[0] not in (".hydra", "train.log", ".lock")
    }


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)  # copy2: the same bytes and mtimes
    return dst


def _series(run_dir: Path, key: str) -> dict[int, float]:
    """step -> value; fails if a step holds the metric twice."""
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if key in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"{key} logged twice at a step: {steps}"
    return {r["step"]: r[key] for r in rows}


def _expected_lrs(sched: dict, total_steps: int) -> dict[int, float]:
    """The lr logged at step k by a run planned for total_steps: the one step k used (after
    k - 1 schedule steps), not the one after its schedule step (issue 47)."""
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = build_scheduler(opt, OmegaConf.create(sched), total_steps)
    lrs = {}
    for step in range(1, total_steps + 1):
        lrs[step] = opt.param_groups[0]["lr"]
        opt.step()
        scheduler.step()
    return lrs


# What a killed and resumed run must end with as the uninterrupted one did: every value that
# does not measure time.
TIMED = ("_s", "_per_s", "_s_per_sample", "data_wait_share", "peak_mem_mb", "tflops", "mfu")


def _rows(run_dir: Path) -> dict[tuple[int, str], float]:
    """(step, metric) -> value of metrics.jsonl, timing and events left out; no pair twice."""
    pairs: dict[tuple[int, str], float] = {}
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        if "event" in row:
            continue
        for key, value in row.items():
            if "/" in key and not key.endswith(TIMED):
                assert (row["step"], key) not in pairs, f"{key} logged twice at {row['step']}"
                pairs[row["step"], key] = value
    return pairs


def _summary(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        k: v
        for k, v in summary.items()
        if not k.endswith(TIMED) and k not in ("run_dir", "checkpoints")
    }


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """The same best.pt (weights and the score it records), metrics rows and summary."""
    best, ref_best = (d / "checkpoints" / "best.pt" for d in (run_dir, reference))
    assert_same_weights(best, ref_best)
    ref = load_checkpoint(ref_best)["progress"]["checkpointing"]["best"]
    assert load_checkpoint(best)["progress"]["checkpointing"]["best"] == ref
    assert _rows(run_dir) == _rows(reference)
    assert _summary(run_dir) == _summary(reference)


def _output(proc) -> str:
    return proc.stdout + proc.stderr


# ---- the rules, in-process ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "old", "new"),
    [
        ("model.hidden_dims", [512, 256], [256]),
        ("dataset.name", "mnist", "synthetic"),
        ("dataset.val_fraction", 0.1, 0.2),
        ("loss.label_smoothing", 0.0, 0.1),
        ("optimizer.name", "sgd", "adam"),
        ("optimizer.momentum", 0.9, 0.0),
        ("loader.batch_size", 32, 64),
        ("trainer.accumulate_grad_batches", 1, 2),
        ("trainer.seed", 42, 43),
        ("strategy.name", "ddp", "pipeline"),  # the pipeline's per-stage optimizer layout
        ("strategy.name", "pipeline", "tp"),
        ("precision.name", "fp32", "bf16_true"),
        ("brand_new_key", 1, 2),
    ],
)
def test_keys_that_change_what_the_checkpoint_is_are_refused(key, old, new):
    assert refusal_reason(key, old, new)


@pytest.mark.parametrize(
    ("key", "old", "new"),
    [
        ("trainer.max_epochs", 1, 2),
        ("trainer.max_steps", -1, 100),
        ("trainer.log_every_n_steps", 1, 50),
        ("trainer.device", "cpu", "cuda"),
        ("optimizer.lr", 0.001, 0.01),
        ("optimizer.weight_decay", 0.0, 0.01),
        ("optimizer.momentum", 0.9, 0.95),
        ("scheduler.name", "none", "cosine"),
        ("strategy.name", "single", "ddp"),
        ("strategy.name", "ddp", "fsdp"),  # a checkpoint moves between strategies (issue 29)
        ("strategy.name", "fsdp", "tp"),
        ("strategy.name", "tp", "single"),
        ("precision.name", "fp32", "amp"),
        ("loader.num_workers", 0, 2),
        ("dataset.download", True, False),
        ("launcher.nproc_per_node", "1", "2"),
        ("logger.name", "csv", "tensorboard"),
        ("paths.output_dir", "a", "b"),
        ("name", "train", "mine"),
    ],
)
def test_keys_that_may_change_are_allowed(key, old, new):
    assert refusal_reason(key, old, new) is None


def test_the_refusal_names_the_group_option_first_and_the_fix():
    old = {"model": {"_target_": "a.Net", "name": "mnist_cnn", "dropout": 0.1}, "name": "x"}
    new = {"model": {"_target_": "b.Net", "name": "mlp", "dropout": 0.1}, "name": "y"}
    with pytest.raises(UserError) as err:
        config_changes(old, new, "auto", Path("run/checkpoints/last.pt"))
    text = str(err.value)
    assert "model.name=mnist_cnn" in text and "model.name=mlp" in text
    assert "`model=mnist_cnn`" in text and "new run dir" in text and "\n" not in text
    changes = config_changes(
        {"trainer": {"max_epochs": 1}}, {"trainer": {"max_epochs": 3}}, "a", Path("x")
    )
    assert [(c.key, c.old, c.new) for c in changes] == [("trainer.max_epochs", 1, 3)]


def test_rewind_drops_rows_after_the_checkpoint_and_keeps_events(tmp_path):
    """A checkpoint at step 4 recorded 3 jsonl rows; a later row at the same step (the end of
    an epoch, logged after the mid-epoch checkpoint) is dropped too; events stay."""
    rows = [
        {"step": 3, "train/loss": 1.0},
        {"step": 4, "train/loss": 0.9},
        {"step": 4, "event": "resume"},
        {"step": 4, "train/epoch_s": 1.0},  # after the checkpoint
        {"step": 5, "train/loss": 0.8},
        {"step": 5, "event": "preempted"},
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "train/lo'  # torn
    (tmp_path / "metrics.jsonl").write_text(text)
    csv_lines = ["step,epoch,metric,value", "3,0,train/loss,1.0", "4,0,train/loss,0.9"]
    csv_lines += ["4,0,train/epoch_s,1.0", "5,1,train/loss,0.8"]
    (tmp_path / "metrics.csv").write_text("\r\n".join(csv_lines) + "\r\n")
    metrics = MetricsLogger(tmp_path, "csv")
    metrics.rewind(4, {"jsonl": 3, "csv": 3})
    assert [r for r in read_jsonl(tmp_path / "metrics.jsonl")] == [rows[i] for i in (0, 1, 2, 5)]
    assert (tmp_path / "metrics.csv").read_text().splitlines() == csv_lines[:3]
    metrics.log({"train/loss": 0.7}, 5, 1)
    assert metrics.position() == {"jsonl": 5, "csv": 4}
    metrics.close()
    # Without recorded rows (an older checkpoint): by step alone.
    metrics = MetricsLogger(tmp_path, "none")
    metrics.rewind(3, None)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [3, 4, 5]  # 2 events


def test_a_logger_that_never_logs_writes_nothing(tmp_path):
    MetricsLogger(tmp_path, "csv").close()
    assert list(tmp_path.iterdir()) == []


def test_a_fast_forwarded_schedule_equals_one_planned_for_that_length():
    for sched in (
        {"name": "cosine", "warmup_steps": 2, "min_lr": 0.0},
        {"name": "onecycle", "warmup_steps": 0, "max_lr": 0.01, "pct_start": 0.3},
        # FFCV's piecewise-linear "cyclic" lr (+experiment=imagenet_resnet50).
        {
            "name": "onecycle",
            "warmup_steps": 0,
            "max_lr": 0.01,
            "pct_start": 0.1,
            "anneal_strategy": "linear",
            "div_factor": 1.0e4,
            "final_div_factor": 1.0e4,
        },
    ):
        planned = _expected_lrs(sched, 20)
        opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=LR)
        scheduler = build_scheduler(opt, OmegaConf.create(sched), 20, start_step=7)
        assert opt.param_groups[0]["lr"] == planned[8]  # 7 steps done: step 8's rate
        for step in range(9, 21):
            opt.step()
            scheduler.step()
            assert opt.param_groups[0]["lr"] == planned[step]


def test_a_linear_onecycle_falls_in_equal_steps_from_its_peak_to_zero():
    """anneal_strategy=linear with FFCV's factors: a straight line down to ~0 after the peak."""
    sched = {"name": "onecycle", "warmup_steps": 0, "max_lr": 1.0, "pct_start": 0.2}
    sched |= {"anneal_strategy": "linear", "div_factor": 1.0e4, "final_div_factor": 1.0e4}
    lrs = list(_expected_lrs(sched, 41).values())
    peak = lrs.index(max(lrs))
    falls = [a - b for a, b in zip(lrs[peak:], lrs[peak + 1 :])]
    assert falls == pytest.approx([falls[0]] * len(falls)) and lrs[-1] < max(lrs) * 1e-3


def test_carrying_best_links_files_and_sharded_directories(tmp_path):
    """A .pt is hard-linked; a .dcp directory is rebuilt beside the target and renamed over an
    existing one; the source never changes."""
    src_file, src_dir = tmp_path / "a" / "best.pt", tmp_path / "a" / "best.dcp"
    src_dir.mkdir(parents=True)
    src_file.write_bytes(b"weights")
    (src_dir / "meta.pt").write_bytes(b"meta")
    (src_dir / "__0_0.distcp").write_bytes(b"shard")
    dst = tmp_path / "b" / "checkpoints"
    _link_or_copy(src_file, dst / "best.pt")
    assert (dst / "best.pt").stat().st_ino == src_file.stat().st_ino
    (dst / "best.dcp").mkdir()
    (dst / "best.dcp" / "stale").write_bytes(b"old")
    _link_or_copy(src_dir, dst / "best.dcp")
    assert sorted(f.name for f in (dst / "best.dcp").iterdir()) == ["__0_0.distcp", "meta.pt"]
    assert sorted(f.name for f in dst.iterdir()) == ["best.dcp", "best.pt"]  # no temp left
    assert (src_dir / "meta.pt").read_bytes() == b"meta"


# ---- through the CLI ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resume_integrity")


@pytest.fixture(scope="module")
def cosine(root, run_cli_in) -> Path:
    """A finished 2-epoch cosine run: the base of several tests, and the uninterrupted
    reference of the kill test."""
    run_dir = root / "cosine"
    check_ok(run_cli_in([*COSINE, "trainer.max_epochs=2", f"hydra.run.dir={run_dir}"], root))
    return run_dir


@pytest.fixture(scope="module")
def extended(root, cosine, run_cli_in):
    """That run continued to 3 epochs with resume=<its last.pt> in a new run dir."""
    run_dir = root / "extended"
    last = cosine / "checkpoints" / "last.pt"
    args = [*COSINE, "trainer.max_epochs=3", f"resume={last}", f"hydra.run.dir={run_dir}"]
    proc = run_cli_in(args, root)
    check_ok(proc)
    return run_dir, proc


def test_a_refused_key_stops_the_run_and_leaves_the_run_dir_as_it_was(cosine, run_cli, tmp_path):
    """A synthetic-data checkpoint resumed as MNIST (before: progress and best_val_acc were
    silently adopted)."""
    run_dir = _copy_run(cosine, tmp_path / "run")
    before = _snapshot(run_dir)
    synthetic_keys = [a for a in COSINE if not a.startswith("dataset.")]
    proc = run_cli(
        [
            *synthetic_keys,
            "trainer.max_epochs=3",
            "dataset=mnist",
            "resume=auto",
            f"hydra.run.dir={run_dir}",
        ]
    )
    assert proc.returncode == 2, _output(proc)
    assert "Traceback" not in _output(proc)
    assert "dataset.name=synthetic" in proc.stderr and "dataset.name=mnist" in proc.stderr
    assert "`dataset=synthetic`" in proc.stderr and "new run dir" in proc.stderr
    assert _snapshot(run_dir) == before


def test_a_finished_run_is_not_trained_again(cosine, run_cli, tmp_path):
    run_dir = _copy_run(cosine, tmp_path / "run")
    before = _snapshot(run_dir)
    proc = run_cli([*COSINE, "trainer.max_epochs=2", "resume=auto", f"hydra.run.dir={run_dir}"])
    check_ok(proc)
    assert "already finished" in _output(proc)
    assert _snapshot(run_dir) == before  # summary.json, metrics, checkpoints, config.yaml


def test_a_longer_cosine_run_anneals_over_the_new_length(cosine, extended):
    """Resumed at step 8, the end of its schedule, with 3 epochs instead of 2: no crash, the lr
    from step 9 on is that of a schedule planned for 12 steps, and the run ends at step 12."""
    run_dir, proc = extended
    assert "changed on resume: trainer.max_epochs 2 -> 3" in _output(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["epochs"]) == (3 * STEPS_PER_EPOCH, 3)
    lrs = _series(run_dir, "train/lr")
    assert sorted(lrs) == list(range(2 * STEPS_PER_EPOCH + 1, 3 * STEPS_PER_EPOCH + 1))
    planned = _expected_lrs({"name": "cosine", "warmup_steps": 0, "min_lr": 0.0}, 12)
    assert all(lrs[s] == planned[s] for s in lrs)
    # The first 2 epochs annealed to 0 on the 2-epoch curve; the resume moved onto the longer one.
    assert _series(cosine, "train/lr")[8] < lrs[9]
    (event,) = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("event") == "resume"]
    assert event["step"] == 8 and event["changed"]["trainer.max_epochs"] == [2, 3]


def test_resume_into_a_new_run_dir_carries_the_best_checkpoint(cosine, extended, run_cli, tmp_path):
    run_dir, proc = extended
    assert "carried over" in _output(proc)
    best, source = run_dir / "checkpoints" / "best.pt", cosine / "checkpoints" / "best.pt"
    carried_acc = load_checkpoint(source)["progress"]["best_val"]["acc"]
    acc = load_checkpoint(best)["progress"]["best_val"]["acc"]
    if acc == carried_acc:  # not beaten in epoch 2: the very same checkpoint
        assert best.read_bytes() == source.read_bytes()
    else:
        assert acc > carried_acc
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_val_acc"] == acc and summary["test_ckpt"] == "best"
    proc = run_cli([f"ckpt_path={best}", f"out_path={tmp_path / 'eval.json'}"], prog="accel-eval")
    check_ok(proc)
    assert json.loads((tmp_path / "eval.json").read_text())["test/acc"] == summary["test_acc"]


def test_a_new_lr_is_applied_without_a_schedule(run_cli, tmp_path):
    """scheduler=none: before, the restored optimizer state kept the old lr silently."""
    run_dir = tmp_path / "run"
    check_ok(run_cli([*BASE, "trainer.max_epochs=1", f"hydra.run.dir={run_dir}"]))
    proc = run_cli(
        [
            *BASE,
            "trainer.max_epochs=2",
            "optimizer.lr=0.01",
            "optimizer.weight_decay=0.01",
            "resume=auto",
            f"hydra.run.dir={run_dir}",
        ]
    )
    check_ok(proc)
    out = _output(proc)
    for line in (
        "optimizer.lr 0.001 -> 0.01",
        "optimizer.weight_decay 0.0 -> 0.01",
        "trainer.max_epochs 1 -> 2",
    ):
        assert f"changed on resume: {line}" in out
    lrs = _series(run_dir, "train/lr")
    assert lrs == {s: (LR if s <= STEPS_PER_EPOCH else 0.01) for s in range(1, 9)}
    (group,) = load_checkpoint(run_dir / "checkpoints" / "last.pt")["optimizer"]["param_groups"]
    assert (group["lr"], group["weight_decay"]) == (0.01, 0.01)
    (event,) = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("event") == "resume"]
    assert event["changed"]["optimizer.lr"] == [LR, 0.01]


def test_a_longer_onecycle_run_resumes(run_cli, tmp_path):
    """Before: OneCycleLR's fixed total_steps crashed the resume of a longer run."""
    run_dir = tmp_path / "run"
    check_ok(run_cli([*ONECYCLE, "trainer.max_epochs=1", f"hydra.run.dir={run_dir}"]))
    proc = run_cli([*ONECYCLE, "trainer.max_epochs=2", "resume=auto", f"hydra.run.dir={run_dir}"])
    check_ok(proc)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2 * STEPS_PER_EPOCH
    lrs = _series(run_dir, "train/lr")
    assert sorted(lrs) == list(range(1, 9))
    sched = {"name": "onecycle", "warmup_steps": 0, "max_lr": 0.01, "pct_start": 0.3}
    planned = _expected_lrs(sched, 8)
    assert all(lrs[s] == planned[s] for s in range(5, 9))
    assert lrs[4] == _expected_lrs(sched, 4)[4]  # the first epoch: the 1-epoch cycle


def _as_written_before_its_validation(run_dir: Path) -> None:
    """Make last.pt (step 6's, a checkpoint step that validates) what the order before issue 47
    wrote: no `validated_step`, and the metrics position before step 6's validation rows. A
    resume must redo that validation (its score equals the recorded best's: best.pt stays)."""
    path = run_dir / "checkpoints" / "last.pt"
    state = torch.load(path, weights_only=True)
    del state["progress"]["validated_step"]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    state["metrics_rows"]["jsonl"] = next(
        i for i, r in enumerate(rows) if r.get("step") == 6 and "val/loss" in r
    )
    table = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    state["metrics_rows"]["csv"] = next(
        i for i, r in enumerate(table) if r[0] == "6" and r[2].startswith("val/")
    )
    torch.save(state, path)


def test_a_kill_between_checkpoints_leaves_no_duplicate_metrics_and_resume_is_exact(
    cosine, run_cli, tmp_path
):
    """Two kills, then a resume (from a checkpoint made as the old order wrote it) to the end:
    - SIGKILL as step 6's validation starts, a checkpoint step too (issue 47: last.pt was
      written before that validation, so the resumed run skipped it and made a later, worse
      step best.pt): last.pt is step 4's, and the resume redoes steps 5 and 6;
    - SIGKILL at step 8 after checkpoints at steps 3, 4 and 6: step 7's rows were logged after
      the last checkpoint.
    `resume=auto` (same length: the schedule is restored exactly) logs every step once and
    ends with the uninterrupted run's weights, best.pt, metrics rows and summary."""
    (tmp_path / "kill_at.py").write_text(KILLER)
    run_dir = tmp_path / "run"
    common = [*COSINE, "trainer.max_epochs=2", f"hydra.run.dir={run_dir}"]
    kill = ["+callbacks.kill._target_=kill_at.KillAt", "+callbacks.kill.step=6"]
    killed = run_cli([*common, *kill, "+callbacks.kill.at=validation"])
    assert killed.returncode == -9, _output(killed)
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == 4
    killed = run_cli([*common, *kill[:1], "+callbacks.kill.step=8", "resume=auto"])
    assert killed.returncode == -9, _output(killed)
    progress = load_checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]
    assert (progress["step"], progress["validated_step"]) == (6, 6)  # its validation recorded
    assert max(_series(run_dir, "train/loss")) == 7
    _as_written_before_its_validation(run_dir)

    proc = run_cli([*common, "resume=auto"])
    check_ok(proc)
    assert "the checkpoint at step 6 holds no record of its validation: validating now" in (
        _output(proc)
    )
    assert "changed on resume: callbacks.kill._target_ kill_at.KillAt -> <unset>" in _output(proc)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert sorted(_series(run_dir, "train/loss")) == list(range(1, 9))
    assert [r["step"] for r in rows if r.get("event") == "resume"] == [4, 6]
    assert _series(run_dir, "train/loss") == _series(cosine, "train/loss")
    assert_same_weights(run_dir / "checkpoints" / "last.pt", cosine / "checkpoints" / "last.pt")
    assert_same_run(run_dir, cosine)
    csv_rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    csv_pairs = Counter((step, metric) for step, _, metric, _ in csv_rows[1:])
    assert [p for p, n in csv_pairs.items() if n > 1] == []


def test_a_mid_epoch_checkpoint_is_not_resumed_by_another_number_of_processes(run_cli, tmp_path):
    """Mid-epoch, batch_in_epoch counts batches of each process's shard: refused before any
    worker starts, naming both process counts; the run dir is left as it was."""
    run_dir = tmp_path / "run"
    check_ok(run_cli([*BASE, "trainer.max_steps=3", f"hydra.run.dir={run_dir}"]))  # 3 of 4
    before = _snapshot(run_dir)
    proc = run_cli(
        [
            *BASE,
            "trainer.max_steps=6",
            "strategy=ddp",
            "launcher.nproc_per_node=2",
            "resume=auto",
            f"hydra.run.dir={run_dir}",
        ]
    )
    assert proc.returncode == 2, _output(proc)
    assert "Traceback" not in _output(proc)
    assert "written by 1 data-parallel rank (1 process) in the middle of epoch 0" in proc.stderr
    assert "this run has 2 data-parallel ranks" in proc.stderr
    assert "Resume with 1 data-parallel rank (1 process) as the checkpoint was" in proc.stderr
    assert _snapshot(run_dir) == before


# A checkpoint every 2 steps, a validation every half epoch (2 steps): every validation falls on
# a checkpoint step, mid-epoch (steps 2, 6) and at each epoch's end (4, 8); best.pt by val/loss.
# Clipping on, and a target never reached: the same run checks what the console says.
HALVES = [
    *BASE,
    "trainer.max_epochs=2",
    "trainer.ckpt_every_n_steps=2",
    "trainer.val_check_interval=0.5",
    "checkpoint.monitor=val/loss",
    "checkpoint.mode=min",
    "trainer.gradient_clip_val=1.0",
    "trainer.target='val/loss<=0.01'",
    "trainer.progress=plain",
]


@pytest.fixture(scope="module")
def halves(root, run_cli_in):
    """The uninterrupted run of HALVES, and its output."""
    run_dir = root / "halves"
    proc = run_cli_in([*HALVES, f"hydra.run.dir={run_dir}"], root)
    check_ok(proc)
    return run_dir, _output(proc)


def test_a_kill_at_a_half_epoch_validation_resumes_to_the_same_best_rows_and_summary(
    halves, run_cli, tmp_path
):
    """SIGKILL as step 6's validation starts (issue 47: last.pt was step 6's, written before
    that validation): resumed, the run ends as the uninterrupted one did. The resumed run draws
    the rich progress bar (trainer.progress=rich) where the output is no terminal."""
    reference, _ = halves
    (tmp_path / "kill_at.py").write_text(KILLER)
    run_dir = tmp_path / "run"
    common = [*HALVES, f"hydra.run.dir={run_dir}"]
    kill = ["+callbacks.kill._target_=kill_at.KillAt", "+callbacks.kill.step=6"]
    killed = run_cli([*common, *kill, "+callbacks.kill.at=validation"])
    assert killed.returncode == -9, _output(killed)
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == 4
    proc = run_cli([*common, "resume=auto", "trainer.progress=rich"])
    check_ok(proc)
    assert_same_run(run_dir, reference)
    # The bar: the last epoch and the whole run, with steps/s (its final frame, no terminal).
    assert re.search(r"epoch 2/2 .*4/4 .*batches/s", proc.stdout), proc.stdout
    assert re.search(r"run .*8/8 .*steps/s", proc.stdout), proc.stdout


def test_the_console_says_a_target_was_missed_and_logs_the_gradient_norm(halves):
    run_dir, out = halves
    summary = json.loads((run_dir / "summary.json").read_text())
    best = min(v for (_, k), v in _rows(run_dir).items() if k == "val/loss")
    assert summary["target_reached"] is False and summary["target_best"] == best
    assert f"trainer.target val/loss<=0.01 not reached (best val/loss {best:.4f})" in out
    # The norm clipping computed, at every logging step (before clipping: above 1.0 at times).
    norms = _series(run_dir, "train/grad_norm")
    assert sorted(norms) == list(range(1, 9)) and all(n > 0 for n in norms.values())
    # Without a terminal: epoch k/N, step s/T and the ETA on each training line.
    assert re.search(r"epoch 2/2 step 8/8  loss=.* grad_norm=.* ETA \d+:\d\d:\d\d", out)
