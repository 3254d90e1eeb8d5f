"""Reliability: non-finite training values (trainer.on_nonfinite=stop|skip_step), settings that
make a run pointless, damaged data files and accel-eval's failures.

The user-facing paths run through the real console scripts in subprocesses; the many small
cases behind one code path (each pointless setting, each kind of damaged file) are also checked
in-process, which costs milliseconds instead of a torch import each. A multirun (`-m`) runs
several damaged data dirs through the CLI in one process: each job's error is recorded in its
status.json, exactly the UserError a single run prints.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    BIN,
    FAST,
    _write_idx,
    check_ok,
    count_host_reads,
    make_digits,
    read_jsonl,
    write_mnist,
)
from omegaconf import OmegaConf

from accel_train.checkpoint import load_checkpoint
from accel_train.config import CONFIG_DIR, checks
from accel_train.config.checks import validate
from accel_train.config.run_config import resolve
from accel_train.config.schema import EvalConfig
from accel_train.data.builtin import _load_torchvision, hints_for, synthetic_splits
from accel_train.errors import UserError
from accel_train.loggers import json_safe
from accel_train.parallel import process_group
from accel_train.tasks import TaskContext
from accel_train.techniques import Technique
from accel_train.train.build import build_components
from accel_train.train.data_checks import check_data_sizes
from accel_train.train.evaluate import _check_eval_config, _write_result
from accel_train.train.loop import Loop

# A loss module in the run's working directory (importable by _target_): cross-entropy, but
# NaN on training calls `step`..`until` (counted from 1; validation runs under no_grad).
NANLOSS = """
import torch
from torch import nn


class NanAt(nn.Module):
    def __init__(self, step: int = 5, until: int = 0):
        super().__init__()
        self.step, self.until, self.calls = step, until, 0

    def forward(self, logits, targets):
        loss = nn.functional.cross_entropy(logits, targets)
        if torch.is_grad_enabled():
            self.calls += 1
            if self.step <= self.calls <= max(self.step, self.until):
                loss = loss * float("nan")
        return loss
"""


# 256 synthetic samples, 10% held out: 230 training samples, 8 batches of 32 per epoch.
NAN_ARGS = [*FAST, "loss=custom", "loss._target_=nanloss.NanAt", "loader.batch_size=32"]


def _strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not valid JSON")

    return json.loads(text, parse_constant=refuse)


def _finite(state: dict[str, torch.Tensor]) -> bool:
    return all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def _check_error(proc, *expected: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    for text in expected:
        assert text in proc.stderr, f"{text!r} not in stderr:\n{proc.stderr}"
    assert "Traceback" not in output, output


# ---- non-finite loss: stop ------------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_stop(tmp_path_factory, run_cli_in):
    """NaN loss at step 10 (epoch 1), with last.pt saved every step and logging every 4: the
    NaN is found at the save of step 10, between the logging steps 8 and 12."""
    cwd = tmp_path_factory.mktemp("nan_stop")
    (cwd / "nanloss.py").write_text(NANLOSS)
    run = cwd / "run"
    args = [
        *NAN_ARGS,
        "+loss.step=10",
        "trainer.max_steps=16",
        "trainer.log_every_n_steps=4",
        "trainer.ckpt_every_n_steps=1",
        f"hydra.run.dir={run}",
    ]
    return run, run_cli_in(args, cwd)


def test_nan_loss_stops_with_the_step_and_the_last_finite_loss(nan_stop):
    run, proc = nan_stop
    _check_error(
        proc,
        "the training loss was nan at optimizer step 10 (epoch 1",
        "last finite training loss was",
        "(step 9)",
        "optimizer.lr",
        "trainer.gradient_clip_val",
        "trainer.on_nonfinite=skip_step",
        "checkpoints/last.pt",
    )
    assert "(step 10)" in proc.stderr  # found at the save of step 10, not at a logging step
    assert not (run / "summary.json").exists()
    rows = [_strict_json(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (event,) = [r for r in rows if r.get("event") == "nonfinite"]
    assert event["step"] == 10 and event["what"] == "loss"


def test_nan_stop_keeps_the_last_finite_checkpoints(nan_stop):
    run, _ = nan_stop
    last = load_checkpoint(run / "checkpoints" / "last.pt")
    best = load_checkpoint(run / "checkpoints" / "best.pt")
    assert last["progress"]["step"] == 9  # the step before the NaN, never the NaN state
    assert best["progress"]["step"] == 8  # validated after epoch 0
    for ckpt in (last, best):
        assert _finite(ckpt["model"])
        state = ckpt["optimizer"]["state"]
        assert all(_finite(s) for s in state.values())


def test_ddp_ranks_stop_together(run_cli, tmp_path):
    """Two processes agree at the logging step (one small all-reduce) and both stop."""
    (tmp_path / "nanloss.py").write_text(NANLOSS)
    args = [*NAN_ARGS, "+loss.step=3", "trainer.max_steps=6", "trainer.log_every_n_steps=2"]
    args += ["strategy=ddp", "launcher.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = run_cli(args, timeout=300)
    _check_error(proc, "nan at optimizer step 3", "found at the logging step (step 4)")


# ---- non-finite loss: skip_step ---------------------------------------------------------------


def test_skip_step_skips_and_counts(run_cli, tmp_path):
    (tmp_path / "nanloss.py").write_text(NANLOSS)
    run = tmp_path / "run"
    proc = run_cli(
        [
            *NAN_ARGS,
            "+loss.step=3",
            "+loss.until=4",
            "trainer.on_nonfinite=skip_step",
            "trainer.max_steps=8",
            "trainer.log_every_n_steps=4",
            "trainer.test_after_fit=false",
            f"hydra.run.dir={run}",
        ]
    )
    check_ok(proc)
    assert "skipped 2 optimizer step(s)" in proc.stdout + proc.stderr
    logged = [r for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert [r["train/skipped_steps"] for r in logged] == [2, 2]
    assert all(math.isfinite(r["train/loss"]) for r in logged)  # the finite steps' mean
    assert _finite(load_checkpoint(run / "checkpoints" / "last.pt")["model"])
    summary = _strict_json((run / "summary.json").read_text())
    assert summary["steps"] == 8
    assert summary["skipped_steps"] == 2 and summary["on_nonfinite"] == "skip_step"


class _Marks(Technique):
    """Host reads counted at each step's end (as test_architecture's hot-path test does)."""

    name = "marks"

    def __init__(self, counter):
        self.counter, self.marks = counter, []

    def on_train_step_end(self, loop):
        self.marks.append((loop.step, len(self.counter)))


@pytest.mark.parametrize("mode", ["stop", "skip_step"])
def test_no_host_read_between_logging_steps(mode, compose_cfg, tmp_path, monkeypatch):
    """`stop` and `skip_step` with a fused optimizer decide on the device: no host read at the
    steps between logging steps (6 and 11 are the steps after the logging steps 5 and 10)."""
    (tmp_path / "nanloss.py").write_text(NANLOSS)
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = [
        *FAST,
        "loss=custom",
        "loss._target_=nanloss.NanAt",
        "+loss.step=3" if mode == "skip_step" else "+loss.step=100",
        "+loss.until=4",
        f"trainer.on_nonfinite={mode}",
        "optimizer.fused=true",
        "loader.batch_size=16",
        "trainer.max_steps=12",
        "trainer.log_every_n_steps=5",
        "trainer.limit_val_batches=2",
        "trainer.test_after_fit=false",
        "logger=none",
        f"paths.output_dir={tmp_path}",
    ]
    cfg = resolve(compose_cfg(overrides))
    with process_group("cpu") as env:
        parts = build_components(cfg, env)
        calls = count_host_reads(monkeypatch)
        marks = _Marks(calls)
        parts.techniques.append(marks)
        loop = Loop(cfg, env, parts)
        loop.fit()
        monkeypatch.undo()
    counts = dict(marks.marks)
    per_step = {s: counts[s] - counts[s - 1] for s in range(2, 13)}
    quiet = {s: n for s, n in per_step.items() if s not in (6, 11)}
    assert all(n == 0 for n in quiet.values()), (quiet, calls)
    (nonfinite,) = [t for t in parts.techniques if t.name == "nonfinite"]
    assert nonfinite.skipped == (2 if mode == "skip_step" else 0)
    assert all(torch.isfinite(p).all() for p in loop.module.parameters())


# ---- pointless settings -----------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _every_warning_again():
    checks._warned.clear()  # the checks warn once per process; each test wants its own


@pytest.fixture(scope="module")
def cfg_with(compose_cfg):
    """cfg_with(overrides): Hydra composes once per choice of options (`group=option`, the slow
    part); `key=value` overrides are then set on a copy, typed by the schema as Hydra would."""
    composed: dict[tuple[str, ...], object] = {}

    def make(overrides):
        groups = tuple(o for o in overrides if "." not in o.split("=")[0])
        if groups not in composed:
            composed[groups] = compose_cfg([*groups, "paths.output_dir=unused"])
        cfg = composed[groups].copy()
        for o in overrides:
            key, value = o.split("=", 1)
            if "." in key:
                OmegaConf.update(cfg, key, OmegaConf.create(f"v: {value}").v, merge=False)
        return cfg

    return make


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["scheduler=onecycle", "scheduler.max_lr=0"], "scheduler.max_lr=0"),
        (["scheduler=onecycle", "scheduler.pct_start=1.0"], "scheduler.pct_start"),
        (["scheduler=onecycle", "scheduler.anneal_strategy=lin"], "scheduler.anneal_strategy"),
        (["scheduler=onecycle", "scheduler.div_factor=0.5"], "scheduler.div_factor"),
        (["scheduler=cosine", "scheduler.min_lr=0.5"], "scheduler.min_lr=0.5"),
        (["scheduler=step", "scheduler.gamma=0"], "scheduler.gamma=0"),
        (["scheduler=step", "scheduler.step_size=0"], "scheduler.step_size=0"),
        (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay"),
        (["optimizer.betas=[1.0,0.9]"], "optimizer.betas"),
        (["optimizer=sgd", "optimizer.momentum=0"], "optimizer.nesterov"),
        (["dataset.num_classes=1"], "dataset.num_classes=1"),
        (["dataset.std=[0.0]"], "dataset.std"),
        (["loss.label_smoothing=1.0"], "loss.label_smoothing"),
        (["model=mlp", "model.dropout=1.0"], "model.dropout"),
        (["dataset.num_train=0"], "dataset.num_train"),
        (["trainer.on_nonfinite=ignore"], "trainer.on_nonfinite"),
    ],
)
def test_pointless_settings_are_refused(overrides, key, cfg_with):
    cfg = cfg_with(overrides)
    with pytest.raises(UserError, match=re.escape(key)):
        validate(cfg)


@pytest.mark.parametrize(
    ("overrides", "warning"),
    [
        (["trainer.gradient_clip_val=1e-6"], "trainer.gradient_clip_val=1e-06"),
        (["trainer.max_epochs=2", "trainer.val_every_n_epochs=3"], "val_every_n_epochs=3"),
        (["scheduler=step", "scheduler.gamma=2"], "scheduler.gamma=2"),
        (["optimizer.eps=0"], "optimizer.eps=0"),
    ],
)
def test_doubtful_settings_are_warned(overrides, warning, cfg_with, caplog):
    validate(cfg_with(overrides))
    assert warning in caplog.text


def _sizes(cfg, **given):
    sizes = dict(num_train=230, num_val=26, world_size=1)
    sizes.update(total_steps=100, max_epochs=13)  # 8 batches (steps) per epoch
    sizes.update(given)
    return check_data_sizes(cfg, **sizes)


@pytest.mark.parametrize(
    ("overrides", "sizes", "warning"),
    [
        (["trainer.limit_train_batches=100"], {}, "limit_train_batches=100 has no effect"),
        (["trainer.limit_val_batches=100"], {}, "limit_val_batches=100 has no effect"),
        (["trainer.accumulate_grad_batches=16"], {}, "accumulate_grad_batches=16 is more"),
        (["trainer.max_steps=100", "trainer.val_every_n_epochs=20"], {}, "validation runs only"),
        (["trainer.log_every_n_steps=200"], {}, "no train/loss is logged"),
        (["trainer.ckpt_every_n_steps=200"], {}, "ckpt_every_n_steps=200 is more"),
        (["scheduler=step", "scheduler.step_size=100"], {}, "before the first decay"),
    ],
)
def test_sizes_that_make_settings_pointless_are_warned(overrides, sizes, warning, cfg_with, caplog):
    _sizes(cfg_with(["loader.batch_size=32", *overrides]), **sizes)
    assert warning in caplog.text


def test_the_samples_one_validation_scores_are_counted(cfg_with):
    assert _sizes(cfg_with(["loader.batch_size=32"])) == 26
    one_batch = cfg_with(["loader.batch_size=4", "trainer.limit_val_batches=1"])
    assert _sizes(one_batch) == 4
    assert _sizes(one_batch, world_size=2) == 8


def _classifier_setup(compose_cfg, tmp_path, overrides, data_args=None):
    """The classification task set up by the real build (synthetic data: 10 classes)."""
    cfg = resolve(compose_cfg([*FAST, "logger=none", f"paths.output_dir={tmp_path}", *overrides]))
    with process_group("cpu") as env:
        parts = build_components(cfg, env)
        if data_args is not None:  # the same task given other data
            ctx = TaskContext(cfg, env.device, data_args, parts.batch_transform, parts.module, None)
            type(parts.task)().setup(ctx)


def test_a_classifier_warns_when_validation_scores_fewer_samples_than_classes(
    compose_cfg, tmp_path, caplog
):
    _classifier_setup(compose_cfg, tmp_path, ["loader.batch_size=4", "trainer.limit_val_batches=1"])
    assert "validation scores only 4 samples for 10 classes" in caplog.text


def test_a_classifier_on_one_class_is_refused(compose_cfg, tmp_path):
    with pytest.raises(UserError, match=r"the data set has 1 class\(es\)"):
        _classifier_setup(compose_cfg, tmp_path, [], {"num_classes": 1})


def test_a_val_fraction_that_holds_out_nothing_is_refused():
    with pytest.raises(UserError, match=r"dataset.val_fraction=0.01 holds out no sample"):
        synthetic_splits(num_train=40, num_test=8, val_fraction=0.01)


def test_a_pointless_setting_through_the_cli(run_cli):
    proc = run_cli([*FAST, "dataset.num_train=40", "dataset.val_fraction=0.01"])
    _check_error(proc, "dataset.val_fraction=0.01", "holds out no sample", "val_fraction=0.1")


# ---- damaged data files ---------------------------------------------------------------------


RAW = Path("MNIST") / "raw"


def _damage(root: Path, how: str) -> Path:
    """A tiny MNIST under root with one kind of damage; returns the damaged file."""
    write_mnist(root, n_train=64, n_test=16)
    raw = root / RAW
    images, labels = raw / "train-images-idx3-ubyte", raw / "train-labels-idx1-ubyte"
    if how == "magic":
        images.write_bytes(b"\x12\x34\x56\x78" + images.read_bytes()[4:])
        return images
    if how == "truncated":
        data = images.read_bytes()
        images.write_bytes(data[: len(data) // 2])
        return images
    if how == "count":
        _write_idx(labels, make_digits(60, seed=1)[1])
        return images
    if how == "labels":
        bad = make_digits(64, seed=1)[1]
        bad[5] = 12
        _write_idx(labels, bad)
        return labels
    if how == "swapped":
        images.write_bytes(labels.read_bytes())
        return images
    if how == "gzip":
        images.write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 64)
        return images
    if how == "directory":
        images.unlink()
        images.mkdir()
        return images
    if how == "extra":
        images.write_bytes(images.read_bytes() + b"\x00" * 10)
        return images
    raise AssertionError(how)


DAMAGE = {
    "magic": "is not an IDX file of images: it starts with 12 34 56 78",
    "truncated": "is truncated: its header announces 64 x 28 x 28 bytes",
    "count": "holds 64 images but train-labels-idx1-ubyte beside it holds 60 labels",
    "labels": "holds label 12 (sample 5",
    "swapped": "are the images and labels files swapped?",
    "gzip": "is gzip-compressed",
    "directory": "is a directory, not a data file",
    "extra": "is 10 bytes longer than its header announces",
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_each_damaged_file_is_named_as_what_it_is(how, tmp_path):
    bad = _damage(tmp_path, how)
    with pytest.raises(UserError) as err:
        _load_torchvision("mnist", str(tmp_path), download=True, train=True)
    msg = str(err.value)
    assert DAMAGE[how] in msg and str(bad.resolve()) in msg
    assert "not under" not in msg and "download failed" not in msg


def test_a_corrupt_cifar_file_is_named(tmp_path):
    """CIFAR-10's files are pickles with official MD5 sums: a damaged one is named as corrupt
    (torchvision itself only says "not found or corrupted")."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"]:
        (folder / name).write_bytes(b"not the official file")
    with pytest.raises(UserError) as err:
        _load_torchvision("cifar10", str(tmp_path), download=True, train=True)
    msg = str(err.value)
    assert f"{(folder / 'data_batch_1').resolve()} is corrupt or not the official file" in msg
    assert "data_batch_5" in msg and "not under" not in msg


def _drop_dac(cmd: list[str]) -> list[str] | None:
    """The command as an ordinary user would run it, for whom a chmod 000 file is unreadable.
    Root reads any file whatever its mode: run it as root without the two capabilities that
    bypass file permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH). None: cannot here."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        return None
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]


def test_damaged_files_through_the_cli(tmp_path):
    """Each damaged data dir is one job of a multirun (one process, one torch import): each job
    records the error a single run prints as its one paragraph (exit 2; see e.g.
    test_a_pointless_setting_through_the_cli for that path), naming the file."""
    cases = ["truncated", "magic", "count", "labels", "swapped", "unreadable"]
    for how in cases[:-1]:
        _damage(tmp_path / how, how)
    write_mnist(tmp_path / "unreadable", n_train=64, n_test=16)
    locked = tmp_path / "unreadable" / RAW / "train-labels-idx1-ubyte"
    locked.chmod(0)
    sweep = tmp_path / "sweep"
    cmd = [str(BIN / "accel-train"), "-m", "dataset=mnist", "model=mlp", "trainer.progress=none"]
    cmd += [f"hydra.sweep.dir={sweep}"]
    as_user = _drop_dac(cmd)
    if as_user is None:  # root without setpriv: a chmod 000 file is readable; test the rest
        cases.pop()
    dirs = ",".join(str(tmp_path / how) for how in cases)
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run(
        [*(as_user or cmd), f"paths.data_dir={dirs}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr  # every job failed, each with its reason
    assert "Traceback" not in proc.stdout + proc.stderr
    expected = {**DAMAGE, "unreadable": "is not readable: permission denied"}
    for job, how in enumerate(cases):
        status = json.loads((sweep / str(job) / "status.json").read_text())
        assert status["status"] == "failed"
        assert expected[how] in status["error"], status["error"]
        assert str((tmp_path / how).resolve()) in status["error"]
        assert "not under" not in status["error"] and "download failed" not in status["error"]
        assert status["error"].startswith(f"dataset=mnist: the data file {tmp_path}")
    if as_user is None:
        pytest.skip("running as root without setpriv: the unreadable file was not tested")


# ---- accel-eval ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mnist_ckpt(nan_stop, tmp_path_factory):
    """nan_stop's best.pt (mlp, 1x28x28, 10 classes) relabelled as an MNIST run whose data dir
    has since moved: the weights fit MNIST's shape."""
    run, _ = nan_stop
    ckpt = torch.load(run / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    root = tmp_path_factory.mktemp("eval")
    mnist = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "dataset" / "mnist.yaml"))
    mnist.pop("defaults")
    mnist["download"] = False  # offline: no download attempt when the data is not there
    ckpt["config"]["dataset"] = mnist
    ckpt["config"]["paths"]["data_dir"] = str(root / "moved-away")
    ckpt["config"]["loss"] = {"_target_": "torch.nn.CrossEntropyLoss", "name": "custom"}
    path = root / "checkpoints" / "best.pt"
    path.parent.mkdir()
    torch.save(ckpt, path)
    return path


def test_eval_without_ckpt_path(run_cli):
    _check_error(run_cli([], prog="accel-eval"), "ckpt_path is required", "ckpt_path=outputs/")


def test_eval_of_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best.pt").write_bytes(b"")
    ecfg = OmegaConf.create({"ckpt_path": str(tmp_path), "batch_size": 0, "device": "cpu"})
    with pytest.raises(UserError) as err:
        _check_eval_config(ecfg)
    assert f"ckpt_path={tmp_path} is a directory, not a checkpoint" in str(err.value)
    assert "It holds checkpoints/best.pt" in str(err.value)


def test_eval_when_the_data_moved(mnist_ckpt, run_cli):
    proc = run_cli([f"ckpt_path={mnist_ckpt}"], prog="accel-eval")
    _check_error(proc, "moved-away", "`data_dir=...`")
    assert "paths.data_dir=" not in proc.stderr and "dataset=synthetic" not in proc.stderr
    assert "dataset.*" not in proc.stderr  # accel-train's "fix the arguments" hint


def test_eval_prints_the_result_before_a_failed_write(mnist_ckpt, run_cli, tmp_path):
    data = write_mnist(tmp_path / "data", n_train=64, n_test=16)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = blocker / "result.json"
    proc = run_cli(
        [f"ckpt_path={mnist_ckpt}", f"data_dir={data}", f"out_path={out}"], prog="accel-eval"
    )
    _check_error(proc, f"out_path={out}", "printed above", "`out_path=...`")
    assert "test/acc=" in proc.stdout and "(16 samples)" in proc.stdout


def test_eval_checks_its_own_keys(tmp_path):
    ckpt = tmp_path / "best.pt"
    ckpt.write_bytes(b"")
    cases = [
        ({"device": "gpu"}, "device='gpu' is not one of auto, cpu, cuda"),
        ({"batch_size": -1}, "batch_size=-1 must be >= 0"),
        ({"ckpt_path": "???"}, "ckpt_path is required"),
        ({"split": "dev"}, "split='dev' is not one of test, val, train"),
        ({"data_path": str(tmp_path / "none.jsonl")}, "none.jsonl: no such file"),
    ]
    if not torch.cuda.is_available():
        cases.append(({"device": "cuda"}, "device=cuda but this machine has no usable CUDA"))
    for change, expected in cases:
        values = {"ckpt_path": str(ckpt), **change}
        with pytest.raises(UserError) as err:
            _check_eval_config(OmegaConf.merge(OmegaConf.structured(EvalConfig), values))
        assert expected in str(err.value)
        assert "trainer." not in str(err.value)


def test_eval_data_errors_name_eval_keys(tmp_path):
    _damage(tmp_path, "labels")
    with hints_for("accel-eval"), pytest.raises(UserError) as err:
        _load_torchvision("mnist", str(tmp_path), download=True, train=True)
    assert "`data_dir=...`" in str(err.value)
    with hints_for("accel-eval"), pytest.raises(UserError) as err:
        _load_torchvision("mnist", str(tmp_path / "elsewhere"), download=False, train=True)
    msg = str(err.value)
    assert "`data_dir=...`" in msg and "paths.data_dir=" not in msg and "synthetic" not in msg


def test_eval_result_with_a_nan_loss_is_strict_json(tmp_path):
    out = tmp_path / "r.json"
    _write_result({"test/loss": float("nan"), "test/acc": 0.1}, out, given=True)
    assert _strict_json(out.read_text()) == {"test/loss": None, "test/acc": 0.1}


def test_json_safe_makes_strict_json():
    text = json.dumps(json_safe({"a": float("inf"), "b": [1.0, float("nan")], "c": 2}))
    assert _strict_json(text) == {"a": None, "b": [1.0, None], "c": 2}
