"""The memory techniques as switches, through the real CLI: EMA of the weights (validation and
best.pt use the average, resume stays exact), activation checkpointing (the same run with less
memory), loader.batch_size=auto (a probed size, its table, reused on resume)."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import FAST, assert_same_weights, check_ok, count_host_reads, read_jsonl
from omegaconf import OmegaConf
from torch import nn

from accel_train.checkpoint import load_checkpoint
from accel_train.config.checks import validate
from accel_train.config.run_config import resolve
from accel_train.errors import UserError
from accel_train.parallel import process_group
from accel_train.techniques import Technique
from accel_train.techniques.activation_checkpointing import ActivationCheckpointing
from accel_train.techniques.ema import Ema
from accel_train.train.auto_batch import FEW_STEPS, resolve_batch_size
from accel_train.train.build import build_components
from accel_train.train.loop import Loop

# Minutes of CLI runs: left out of the default run (and CI) to keep CI under 20 minutes;
# `pytest -m slow` runs them. Nothing else in the default run trains with
# EMA, activation checkpointing and loader.batch_size=auto.

# 256 samples, 10% validation -> 230 train / 32 per batch = 8 batches = 8 steps per epoch.
EXACT = [
    *FAST,
    "loader.batch_size=32",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "trainer.test_after_fit=false",
]


def _ckpt(run_dir: Path, name: str) -> dict:
    return load_checkpoint(run_dir / "checkpoints" / name)


def _losses(run_dir: Path) -> dict[int, float]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_ema_validates_the_average_and_resumes_exactly(run_cli, tmp_path):
    ema = ["ema.enabled=true", "ema.decay=0.9", "ema.start_step=2", "ema.warmup=true"]
    ema.append("trainer.max_epochs=2")
    straight, first = tmp_path / "straight", tmp_path / "first"
    check_ok(run_cli([*EXACT, *ema, f"hydra.run.dir={straight}"]))
    # The same run stopped after one epoch, then resumed in its run dir.
    check_ok(run_cli([*EXACT, *ema[:-1], "trainer.max_epochs=1", f"hydra.run.dir={first}"]))
    check_ok(run_cli([*EXACT, *ema, "resume=auto", f"hydra.run.dir={first}"]))

    last, resumed = _ckpt(straight, "last.pt"), _ckpt(first, "last.pt")
    average = last["techniques"]["ema"]["tensors"]
    # last.pt: the training weights as `model`, the average beside them, both exact on resume.
    assert any(not torch.equal(last["model"][k], average[k]) for k in average)
    assert_same_weights(straight / "checkpoints" / "last.pt", first / "checkpoints" / "last.pt")
    for k, v in average.items():
        assert torch.equal(v, resumed["techniques"]["ema"]["tensors"][k]), k
    # best.pt: the average that was validated is its `model` (what accel-eval scores).
    best = _ckpt(straight, "best.pt")
    best_average = best["techniques"]["ema"]["tensors"]
    for k, v in best_average.items():
        assert torch.equal(best["model"][k], v), k
    assert _losses(straight) == {**_losses(first)}  # the resume relogged nothing differently


def test_ema_warmup_ramps_the_decay_from_the_first_averaging_update():
    plain = Ema(0.999, start_step=4, warmup=False)
    warm = Ema(0.999, every_n_steps=2, start_step=4)  # warm-up: the default
    assert plain.decay_at(5) == plain.decay_at(10_000) == 0.999
    # The n-th averaging update (steps 6, 8, 10, ...) uses min(decay, (1 + n) / (10 + n)).
    assert [warm.decay_at(s) for s in (6, 8, 10)] == [1 / 10, 2 / 11, 3 / 12]
    assert warm.decay_at(100_000) == 0.999


def test_activation_checkpointing_trains_the_same(run_cli, tmp_path):
    """mnist_cnn (nn.Sequential segments) and resnet18 (its BasicBlocks, with BatchNorm):
    the same losses and bit-identical weights and BatchNorm statistics as without."""
    common = [
        *EXACT,
        "trainer.max_steps=3",
        "trainer.limit_val_batches=1",
        "logger=csv",
        "optimizer=sgd",  # no optimizer state: resnet18's checkpoints stay at 45 MB
        "optimizer.momentum=0",
        "optimizer.nesterov=false",
    ]
    models = {
        "mnist_cnn": ["model=mnist_cnn", "dataset.image_size=12"],
        "resnet18": ["model=resnet18", "dataset.image_size=8", "dataset.in_channels=3"],
    }
    for name, model in models.items():
        runs = {}
        for mode in ("off", "full" if name == "resnet18" else "selective"):
            run_dir = tmp_path / f"{name}-{mode}"
            switch = f"activation_checkpointing.mode={mode}"
            proc = run_cli([*common, *model, switch, f"hydra.run.dir={run_dir}"], timeout=600)
            check_ok(proc)
            runs[mode] = run_dir
            if mode != "off":
                blocks = "8 of 8 blocks (BasicBlock)"
                what = "2 of 4 nn.Sequential" if name == "mnist_cnn" else blocks
                assert what in proc.stdout + proc.stderr
        off, on = runs.values()
        assert _losses(off) == _losses(on) and len(_losses(on)) == 3
        assert_same_weights(off / "checkpoints" / "last.pt", on / "checkpoints" / "last.pt")


def test_activation_checkpointing_errors(run_cli):
    switch = ["activation_checkpointing.mode=full", "activation_checkpointing.classes=[Nope]"]
    proc = run_cli([*FAST, *switch])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "activation_checkpointing.classes=['Nope']" in proc.stderr and "Linear" in proc.stderr
    # A model with nothing to checkpoint (in-process: the transform alone).
    ctx = SimpleNamespace(cfg=OmegaConf.create({"trainer": {"compile": False}}))
    with pytest.raises(UserError, match=r"activation_checkpointing\.classes=\[pkg"):
        ActivationCheckpointing("full").transform(nn.Linear(4, 2), ctx)


def test_auto_batch_size_probes_records_and_resumes(run_cli, tmp_path):
    run_dir = tmp_path / "run"
    auto = [
        *EXACT,
        "loader.batch_size=auto",
        "loader.max_batch_size=16",
        "trainer.global_batch_size=16",
    ]
    check_ok(run_cli([*auto, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"]))
    with open(run_dir / "batch_size_probe.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(r["batch_size"]) for r in table][:1] == [2] and len(table) >= 2
    assert all(r["status"] == "ok" for r in table)
    chosen = OmegaConf.load(run_dir / "config.yaml")
    size, accum = chosen.loader.batch_size, chosen.trainer.accumulate_grad_batches
    assert size in {int(r["batch_size"]) for r in table} and size * accum == 16
    assert _ckpt(run_dir, "last.pt")["config"]["loader"]["batch_size"] == size

    # Resume: the recorded size, no new probe. Then the same run given that size outright:
    # the probe left no trace, the weights are the same.
    table_mtime = (run_dir / "batch_size_probe.csv").stat().st_mtime_ns
    proc = run_cli([*auto, "trainer.max_steps=4", "resume=auto", f"hydra.run.dir={run_dir}"])
    check_ok(proc)
    assert "as recorded in the checkpoint" in proc.stdout + proc.stderr
    assert "batch size probe:" not in proc.stdout + proc.stderr
    assert (run_dir / "batch_size_probe.csv").stat().st_mtime_ns == table_mtime
    fixed = tmp_path / "fixed"
    given = [f"loader.batch_size={size}", f"trainer.accumulate_grad_batches={accum}"]
    check_ok(run_cli([*EXACT, *given, "trainer.max_steps=4", f"hydra.run.dir={fixed}"]))
    assert_same_weights(run_dir / "checkpoints" / "last.pt", fixed / "checkpoints" / "last.pt")


def test_auto_batch_size_warns_when_its_choice_leaves_few_steps_an_epoch(
    compose_cfg, tmp_path, caplog
):
    """No trainer.global_batch_size: a size leaving under FEW_STEPS steps an epoch is warned."""
    overrides = [*FAST, "dataset.num_train=64", "loader.batch_size=auto", "logger=none"]
    cfg = resolve(compose_cfg([*overrides, f"paths.output_dir={tmp_path}"]))
    with process_group("cpu") as env:
        resolve_batch_size(cfg, env)
    size = cfg.loader.batch_size
    steps = 58 // size  # 64 images less the 10 % validation share: 58 to train on
    warned = f"loader.batch_size=auto chose {size}: an epoch of 58 samples per process is only"
    assert (warned in caplog.text) == (steps < FEW_STEPS), (size, caplog.text[-2000:])
    if steps < FEW_STEPS:  # (every size but 2: a size within 5 % of the fastest, the smallest)
        assert "trainer.global_batch_size=<the batch the learning rate was tuned" in caplog.text


def test_auto_batch_size_with_nothing_to_probe_is_refused(run_cli):
    """Found by the probe itself, at run time: one paragraph, exit 2."""
    proc = run_cli([*FAST, "loader.batch_size=auto", "loader.max_batch_size=1"])
    assert proc.returncode == 2, proc.stderr
    assert "loader.batch_size=auto: no power of two" in proc.stderr
    assert "Traceback" not in proc.stderr


# Refused by the config checks (config/checks.py validate, which the CLI runs before anything
# else; tests/test_errors.py shows such a refusal through the CLI): checked in-process.
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["loader.batch_size=big"], "loader.batch_size='big'"),
        (["trainer.global_batch_size=64"], "only works with loader.batch_size=auto"),
        (["ema.enabled=true", "ema.decay=1"], "ema.decay=1.0 must be in [0, 1)"),
        (["activation_checkpointing.mode=some"], "activation_checkpointing.mode='some'"),
    ],
    ids=["batch-type", "global-without-auto", "ema-decay", "ac-mode"],
)
def test_memory_technique_errors(args, expected, compose_cfg, tmp_path):
    cfg = compose_cfg([*FAST, *args, f"paths.output_dir={tmp_path}"])
    with pytest.raises(UserError) as refused:
        validate(cfg)
    assert expected in str(refused.value)


def test_fsdp_with_activation_checkpointing_and_ema(run_cli, tmp_path):
    """Two gloo processes: FSDP still shards by the (now checkpoint-wrapped) blocks; the EMA
    is updated shard by shard, saved whole in the sharded checkpoint and resumed."""
    run_dir = tmp_path / "run"
    args = [
        *FAST,
        "model=resnet18",
        "dataset.image_size=8",
        "dataset.in_channels=3",
        "strategy=fsdp",
        "launcher.nproc_per_node=2",
        "loader.batch_size=16",
        "trainer.log_every_n_steps=1",
        "trainer.test_after_fit=false",
        "activation_checkpointing.mode=full",
        "ema.enabled=true",
        f"hydra.run.dir={run_dir}",
    ]
    check_ok(run_cli([*args, "trainer.max_steps=2"], timeout=300))
    meta = load_checkpoint(run_dir / "checkpoints" / "last.dcp" / "meta.pt")
    average = meta["techniques"]["ema"]["tensors"]
    assert average["layer1.0.conv1.weight"].shape == (64, 64, 3, 3)  # whole, gathered
    proc = run_cli([*args, "trainer.max_steps=3", "resume=auto"], timeout=300)
    check_ok(proc)
    assert "resumed from" in proc.stdout + proc.stderr
    after = load_checkpoint(run_dir / "checkpoints" / "last.dcp" / "meta.pt")
    assert after["progress"]["step"] == 3
    moved = after["techniques"]["ema"]["tensors"]["fc.weight"]
    assert not torch.equal(moved, average["fc.weight"])


class _Marks(Technique):
    """Records how many host reads had happened at each step's end."""

    def __init__(self, calls):
        self.calls, self.marks = calls, {}

    def on_train_step_end(self, loop):
        self.marks[loop.step] = len(self.calls)


def test_ema_and_activation_checkpointing_never_sync_between_logging_steps(
    compose_cfg, tmp_path, monkeypatch
):
    calls = count_host_reads(monkeypatch)
    cfg = compose_cfg(
        [
            *FAST,
            "loader.batch_size=16",
            "trainer.max_steps=8",
            "trainer.log_every_n_steps=4",
            "trainer.limit_val_batches=1",
            "trainer.test_after_fit=false",
            "logger=none",
            "ema.enabled=true",
            "ema.start_step=2",
            "activation_checkpointing.mode=selective",
            f"paths.output_dir={tmp_path}",
        ]
    )
    cfg = resolve(cfg)
    with process_group("cpu") as env:
        parts = build_components(cfg, env)
        marks = _Marks(calls)
        parts.techniques.append(marks)  # after ema: its count includes ema's update
        Loop(cfg, env, parts).fit()
    per_step = {s: marks.marks[s] - marks.marks[s - 1] for s in range(2, 9)}
    # Step 4 logs (its sync shows in step 5's count); no other step reads the device.
    assert all(n == 0 for s, n in per_step.items() if s != 5), (per_step, calls)
    assert per_step[5] >= 1, "the counter must see the logging sync"
