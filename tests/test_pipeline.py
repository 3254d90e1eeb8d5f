"""strategy=pipeline through the real CLI: CPU, gloo, real processes (issue 12).

The runs start together when the module's first test asks for them (most of their wall time is
importing torch and the rendezvous), then each test waits for its own. One process at a global
batch of 32 is the reference; a 2-stage 1F1B pipeline and a 2-D run (2 stages x 2 DDP replicas,
GPipe, accumulation) must follow the same loss trajectory. SGD with gradient clipping, so that
the clip (over all stages' gradients) changes the steps; 250 samples leave a short last batch.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from helpers import Proc, train_losses

from accel_train.config.run_config import resolve
from accel_train.errors import UserError
from accel_train.launchers.world import check_strategy

# Minutes of CLI runs: left out of the default run (and CI) to keep CI under 20 minutes;
# `pytest -m slow` runs them. Nothing else in the default run trains with
# strategy=pipeline.

BIN = Path(sys.executable).parent

COMMON = [
    "model=mlp",
    "model.dropout=0",
    "dataset=synthetic",
    "dataset.num_train=250",  # 7 x 32 + 26: a short last batch
    "dataset.num_test=40",
    "dataset.val_fraction=0",
    "trainer.progress=none",
    "precision=fp32",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "trainer.seed=3",
    "optimizer=sgd",
    "optimizer.lr=0.1",
    "trainer.gradient_clip_val=0.5",
]
STEPS = 10  # 8 steps per epoch: crosses the short batch and an epoch end
PIPE = ["strategy=pipeline", "launcher.nproc_per_node=2", "loader.batch_size=32"]


def assert_same_trajectory(a: dict[int, float], b: dict[int, float], steps) -> None:
    for step in steps:
        assert a[step] == pytest.approx(b[step], rel=1e-4, abs=1e-5), (step, a, b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    procs = {
        "one": Proc(
            [
                *COMMON,
                "loader.batch_size=32",
                f"trainer.max_steps={STEPS}",
                f"hydra.run.dir={root / 'one'}",
            ],
            root,
            "one",
        ),
        # 2 stages, 1F1B, 4 micro-batches; stops at step 6 and is resumed to STEPS below.
        "pp": Proc(
            [*COMMON, *PIPE, "trainer.max_steps=6", f"hydra.run.dir={root / 'pp'}"], root, "pp"
        ),
        # 2 stages x 2 replicas: 8 per replica x 2 accumulation x 2 replicas = 32.
        "pp2d": Proc(
            [
                *COMMON,
                "strategy=pipeline",
                "strategy.stages=2",
                "strategy.schedule=gpipe",
                "strategy.microbatches=2",
                "launcher.nproc_per_node=4",
                "loader.batch_size=8",
                "trainer.accumulate_grad_batches=2",
                f"trainer.max_steps={STEPS}",
                f"hydra.run.dir={root / 'pp2d'}",
            ],
            root,
            "pp2d",
        ),
        # A split point that is no block: refused in the workers, before training.
        "bad_split": Proc(
            [*COMMON, *PIPE, "strategy.split_points=[nope]", f"hydra.run.dir={root / 'bad'}"],
            root,
            "bad_split",
        ),
    }
    procs["root"] = root
    yield procs
    for proc in procs.values():
        if isinstance(proc, Proc):
            proc.kill()


def test_two_stages_match_one_process_and_resume_exactly(runs):
    """2-stage 1F1B = one process at the same global batch (loss logged on every step, from the
    last stage), the split logged; a resume from its sharded checkpoint at another layout (3
    stages) continues the same trajectory; accel-eval consolidates the stages' checkpoint into
    one model."""
    root = runs["root"]
    runs["one"].ok()
    output = runs["pp"].ok()
    assert "pipeline: 2 stages x 1 replica(s), schedule 1f1b, 4 micro-batches of 8" in output
    assert "stage 0:" in output and "stage 1:" in output
    assert "x 2 pipeline stages = 2 processes" in output
    one, pp = train_losses(root / "one"), train_losses(root / "pp")
    assert_same_trajectory(one, pp, range(1, 7))
    ckpt = root / "pp" / "checkpoints" / "last.dcp"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    resumed = Proc(
        [
            *COMMON,
            "strategy=pipeline",
            "launcher.nproc_per_node=3",  # the mlp's 3 layers, one per stage
            "loader.batch_size=32",
            "resume=auto",
            f"trainer.max_steps={STEPS}",
            f"hydra.run.dir={root / 'pp'}",
        ],
        root,
        "pp_resume",
    )
    assert "pipeline: 3 stages x 1 replica(s)" in resumed.ok()
    assert_same_trajectory(one, train_losses(root / "pp"), range(7, STEPS + 1))

    evals = {
        name: Proc([f"ckpt_path={path}", "device=cpu"], root, f"eval_{name}", prog="accel-eval")
        for name, path in {
            "one": root / "one" / "checkpoints" / "last.pt",
            "pp": root / "pp" / "checkpoints" / "last.dcp",
        }.items()
    }
    scores = {}
    for name, proc in evals.items():
        proc.ok()
        out = root / name / "eval_last.json"
        scores[name] = json.loads(out.read_text())
    assert scores["pp"]["step"] == STEPS
    assert scores["pp"]["test/loss"] == pytest.approx(scores["one"]["test/loss"], rel=1e-4)
    assert scores["pp"]["test/acc"] == scores["one"]["test/acc"]


def test_two_stages_times_two_replicas_match_one_process(runs):
    """2-D (pp=2 x dp=2 DeviceMesh, DDP inside each stage) with accumulation and GPipe."""
    output = runs["pp2d"].ok()
    assert "pipeline: 2 stages x 2 replica(s), schedule gpipe" in output
    assert "x 2 process(es) (x 2 pipeline stages = 4 processes" in output
    runs["one"].ok()
    root = runs["root"]
    assert_same_trajectory(
        train_losses(root / "one"), train_losses(root / "pp2d"), range(1, STEPS + 1)
    )


def test_impossible_layouts_are_one_paragraph_errors(runs, tmp_path):
    code, output = runs["bad_split"].wait()
    assert code == 2, output[-3000:]
    assert "strategy.split_points: 'nope' is no block" in output and "Traceback" not in output
    assert "0, 1, 2, 3, 4" in output  # the blocks it could have named
    # Refused by the launcher before any process starts, through the CLI.
    proc = Proc(
        [
            *COMMON,
            "strategy=pipeline",
            "launcher.nproc_per_node=3",
            "strategy.stages=2",
            f"hydra.run.dir={tmp_path / 'not_divisible'}",
        ],
        tmp_path,
        "not_divisible",
    )
    code, output = proc.wait()
    assert code == 2 and "Traceback" not in output, output[-2000:]
    assert "strategy.stages=2 does not divide the 3 processes" in output


# The launcher's other layout refusals, by the check it runs before it starts any process (the
# CLI path of such a refusal is the one above): (overrides, processes, message).
LAYOUT_REFUSALS = {
    "microbatches": (
        [*PIPE, "strategy.microbatches=5"],
        2,
        "strategy.microbatches=5 does not divide loader.batch_size=32",
    ),
    "one_process": (["strategy=pipeline"], 1, "a pipeline needs at least 2 stages"),
    "interleaved": (
        [*PIPE, "strategy.schedule=interleaved_1f1b"],
        2,
        "interleaved 1F1B needs several stages per process",
    ),
}
# (trainer.compile and the other model transforms with each strategy: test_strategy_transforms.py)


@pytest.mark.parametrize("name", sorted(LAYOUT_REFUSALS))
def test_impossible_layouts_are_refused_before_any_process_starts(name, compose_cfg, tmp_path):
    overrides, nproc, text = LAYOUT_REFUSALS[name]
    cfg = resolve(compose_cfg([*COMMON, *overrides, f"paths.output_dir={tmp_path}"]))
    with pytest.raises(UserError, match=re.escape(text)):
        check_strategy(cfg, nproc)
