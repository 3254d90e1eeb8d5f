"""lightning-hydra-template's spellings as aliases of ours (issue 22, section 5):
config/aliases.py rewrites them; each is checked to compose into a valid config, and the common
ones in real runs through the CLI."""

from __future__ import annotations

import json
import os
import warnings

import pytest
from helpers import FAST, check_ok
from omegaconf import OmegaConf

from accel_train.config.aliases import Aliased, alias_overrides, apply_process_wide
from accel_train.config.checks import validate
from accel_train.errors import UserError

# LHT's spelling -> ours.
ALIASES = {
    "experiment=mnist_amp": ["+experiment=mnist_amp"],
    "debug=fast_dev_run": ["+debug=fast_dev_run"],
    "seed=7": ["trainer.seed=7"],
    "ckpt_path=/runs/a/last.pt": ["resume=/runs/a/last.pt"],
    "test=false": ["trainer.test_after_fit=false"],
    "train=true": [],
    "trainer=cpu": ["trainer.device=cpu"],
    "trainer=gpu": ["trainer.device=cuda"],
    "trainer=ddp": ["strategy=ddp", "launcher.nproc_per_node=auto"],
    "trainer=ddp_sim": ["strategy=ddp", "launcher.nproc_per_node=2", "trainer.device=cpu"],
    "trainer.detect_anomaly=true": [
        "+callbacks.detect_anomaly._target_=accel_train.techniques.anomaly.DetectAnomaly"
    ],
    "callbacks=default": [],
    "callbacks=none": [
        "early_stopping.monitor=null",
        "checkpoint.save_top_k=0",
        "checkpoint.save_last=false",
    ],
    "callbacks=model_checkpoint": ["early_stopping.monitor=null"],
    "callbacks=early_stopping": [
        "early_stopping.monitor=${task.monitor}",
        "early_stopping.mode=${task.monitor_mode}",
    ],
    "callbacks.early_stopping.patience=3": ["early_stopping.patience=3"],
    "callbacks.model_checkpoint.monitor=val/loss": ["checkpoint.monitor=val/loss"],
    "extras.print_config=false": ["trainer.progress=none"],
    "debug=fdr": ["+debug=fast_dev_run"],
    "debug=profiler": ["+debug=profile"],
    "debug=default": [
        "trainer.max_epochs=1",
        "trainer.device=cpu",
        "launcher.nproc_per_node=1",
        "loader.num_workers=0",
        "logger=none",
        "+callbacks.detect_anomaly._target_=accel_train.techniques.anomaly.DetectAnomaly",
    ],
    "debug=limit": [
        "trainer.max_epochs=3",
        "trainer.limit_train_batches=0.01",
        "trainer.limit_val_batches=0.05",
        "trainer.limit_test_batches=0.05",
    ],
    "task_name=lht": ["name=lht"],
    "data=synthetic": ["dataset=synthetic"],
    "trainer.accelerator=cpu": ["trainer.device=cpu"],
    "trainer.devices=2": ["launcher.nproc_per_node=2"],
    "trainer.precision=bf16-mixed": ["precision=bf16"],
    "trainer.precision=16-mixed": ["precision=fp16"],
    "trainer.fast_dev_run=true": ["+debug=fast_dev_run"],
    "trainer.check_val_every_n_epoch=2": ["trainer.val_every_n_epochs=2"],
    "callbacks.model_checkpoint.every_n_train_steps=5": ["trainer.ckpt_every_n_steps=5"],
    "extras.ignore_warnings=true": [],
    "extras.enforce_tags=true": [],
}
# Ours pass through unchanged.
OURS = ["+experiment=mnist_amp", "trainer=default", "trainer.seed=1", "-m", "--cfg", "job"]


@pytest.mark.parametrize("spelling", sorted(ALIASES))
def test_each_alias_becomes_our_overrides(spelling, compose_cfg, tmp_path):
    aliased = alias_overrides([spelling])
    assert aliased.argv == ALIASES[spelling]
    if spelling.startswith(("trainer=gpu", "experiment=", "ckpt_path=")):
        return  # (no CUDA, MNIST or checkpoint here: the CLI test resumes with ckpt_path)
    extra = ["early_stopping.mode=min"] if "val/loss" in spelling else []
    if "val/loss" in spelling:
        extra.append("checkpoint.mode=min")
    cfg = compose_cfg([*aliased.argv, *extra, f"paths.output_dir={tmp_path}"])
    validate(cfg)  # the rewritten overrides are keys and values of ours


def test_ours_pass_through():
    assert alias_overrides(OURS).argv == OURS


def test_logger_aliases():
    loggers = alias_overrides(["logger=many_loggers"]).argv[0]
    assert loggers.startswith("logger=[csv,tensorboard")
    for spelling in ("logger=aim", "logger=[csv,aim]"):
        with pytest.raises(UserError, match="aim convert tensorboard"):
            alias_overrides([spelling])


def test_what_has_no_twin_here_is_refused():
    for spelling, text in (("trainer=mps", "trainer=cpu"), ("trainer.accelerator=tpu", "cuda")):
        with pytest.raises(UserError, match=text):
            alias_overrides([spelling])


def test_train_false_needs_a_checkpoint_and_a_test():
    with pytest.raises(UserError, match="ckpt_path="):
        alias_overrides(["train=false"])
    with pytest.raises(UserError, match="nothing to do"):
        alias_overrides(["train=false", "ckpt_path=a.pt", "test=false"])
    assert alias_overrides(["ckpt_path=a.pt", "train=false"]).test_only == "a.pt"


def test_ignore_warnings_reaches_child_processes(monkeypatch):
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    with warnings.catch_warnings():
        apply_process_wide(Aliased(argv=[], ignore_warnings=True))
        assert os.environ["PYTHONWARNINGS"] == "ignore"


def test_lht_spellings_through_the_cli(run_cli, tmp_path):
    """One run with several of LHT's spellings, then `train=false ckpt_path=` (test only) and
    `ckpt_path=` (resume) on its checkpoints."""
    run = tmp_path / "run"
    common = [*FAST, "trainer=cpu", "logger=none"]
    proc = run_cli(
        [
            *common,
            "seed=3",
            "trainer.max_steps=2",
            "test=false",
            "trainer.detect_anomaly=true",
            "callbacks.model_checkpoint.save_top_k=1",
            "callbacks.early_stopping.patience=2",
            "callbacks.early_stopping.monitor=val/acc",
            "tags=[lht]",
            "extras.enforce_tags=true",
            f"hydra.run.dir={run}",
        ]
    )
    check_ok(proc)
    cfg = OmegaConf.load(run / "config.yaml")
    assert cfg.trainer.seed == 3 and cfg.trainer.device == "cpu"
    assert cfg.trainer.test_after_fit is False and cfg.early_stopping.patience == 2
    assert "detect_anomaly" in proc.stderr + proc.stdout
    assert "test_acc" not in json.loads((run / "summary.json").read_text())  # test=false
    best = run / "checkpoints" / "best.pt"
    proc = run_cli(["train=false", f"ckpt_path={best}", "trainer=cpu"])
    check_ok(proc)
    assert "test/acc=" in proc.stdout + proc.stderr and not (tmp_path / "outputs").exists()
    proc = run_cli(
        [*common, f"ckpt_path={run / 'checkpoints' / 'last.pt'}", "seed=3", "trainer.max_steps=3"]
    )
    check_ok(proc)
    assert "resumed from" in proc.stdout + proc.stderr
    proc = run_cli([*common, "extras.enforce_tags=true", "hydra.run.dir=untagged"])
    assert proc.returncode == 2 and "tags=[" in proc.stderr and "Traceback" not in proc.stderr
