"""Every pair of a multi-process strategy and a model transform (issue 22, section 8): each
either works (one real 2-process run per strategy covers its working transforms together) or is
refused at compose, before any process starts, with one paragraph (config/combinations.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import check_ok, read_jsonl

from accel_train.config.checks import validate
from accel_train.config.combinations import REFUSED, STRATEGIES, TRANSFORMS
from accel_train.config.run_config import resolve
from accel_train.errors import UserError
from accel_train.launchers.world import check_strategy

HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None

# The overrides that turn each transform on (a conv net, so channels_last has convs to change,
# with Linear layers for QAT).
SWITCH = {
    "compile": ["trainer.compile=true"],
    "channels_last": ["trainer.channels_last=true"],
    "activation_checkpointing": ["activation_checkpointing.mode=full"],
    "qat": ["quant=qat"],
    "prune": ["prune.amount=0.5"],
    "lora": ["lora.rank=2"],
}

TINY = [
    "dataset=synthetic",
    "dataset.num_train=256",
    "dataset.num_test=64",
    "model=small_cnn",
    "loader.batch_size=16",
    "logger=none",
    "trainer.progress=none",
]


def test_the_table_names_every_pair():
    assert set(SWITCH) == set(TRANSFORMS)
    assert {s for s, _ in REFUSED} <= set(STRATEGIES) and {t for _, t in REFUSED} <= set(SWITCH)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("transform", sorted(SWITCH))
def test_each_pair_works_or_is_refused_at_compose(strategy, transform, compose_cfg, tmp_path):
    """The config checks the launcher runs before it starts a process (validate, then the
    strategy's layout check for 2 processes): a refused pair fails there with one paragraph
    that names the strategy and the transform; a working one passes them."""
    overrides = [*TINY, f"strategy={strategy}", "launcher.nproc_per_node=2", *SWITCH[transform]]
    cfg = compose_cfg([*overrides, f"paths.output_dir={tmp_path}"])
    why = REFUSED.get((strategy, transform))
    if why is None:
        validate(cfg)
        check_strategy(resolve(cfg), 2)
        return
    with pytest.raises(UserError) as refused:
        validate(cfg)
    message = str(refused.value)
    assert message == why and "\n" not in message
    assert f"strategy={strategy}" in message and "`" in message  # names the way out
    assert SWITCH[transform][0].split("=")[0] in message


def _working(strategy: str) -> list[str]:
    """The transforms that work with `strategy` (QAT only where torchao is installed)."""
    names = [t for t in SWITCH if (strategy, t) not in REFUSED]
    return [t for t in names if t != "qat" or HAVE_TORCHAO]


# One real 2-process run per strategy with every transform it supports switched on together;
# fsdp runs the README's command (`+experiment=mnist_amp strategy=fsdp`, which turns on
# channels_last: FSDP2 refused its parameters before issue 22) on synthetic data.
RUNS = {
    "ddp": [],
    "fsdp": ["+experiment=mnist_amp"],
    "pipeline": ["strategy.microbatches=2"],
}


@pytest.mark.parametrize("strategy", sorted(RUNS))
def test_working_pairs_train_in_two_processes(strategy, run_cli, tmp_path):
    run_dir = tmp_path / "run"
    switches = [s for t in _working(strategy) for s in SWITCH[t]]
    proc = run_cli(
        [
            *RUNS[strategy],
            *TINY,
            f"strategy={strategy}",
            "launcher.nproc_per_node=2",
            *switches,
            "trainer.max_steps=3",
            "trainer.max_epochs=1",
            "trainer.log_every_n_steps=1",
            "trainer.limit_val_batches=1",
            "trainer.target=null",
            f"hydra.run.dir={run_dir}",
        ],
        timeout=600,
    )
    check_ok(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 2
    losses = [r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert len(losses) == 3
    techniques = next(line for line in proc.stderr.splitlines() if "techniques:" in line)
    for name in _working(strategy):
        assert name in techniques, (name, techniques)
    if strategy == "fsdp":
        assert "parameters kept contiguous" in proc.stderr
