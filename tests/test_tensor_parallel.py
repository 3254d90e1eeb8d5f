"""strategy=tp and FSDP x TP (`strategy=fsdp strategy.tp=2`) through the real CLI: gloo
processes on the CPU (issue 29).

The runs start together when the module's first test asks for them, then each test waits for
its own. One process is the reference; TP over 2 processes and 2 x 2 FSDP x TP over 4 must
follow its loss over 20 fp32 steps within 1e-4 (relative). Gradient clipping is on, so that the
global gradient norm over whole, TP-sharded and FSDP x TP-sharded gradients changes every step.
"""

from __future__ import annotations

import re
import shlex

import pytest
from helpers import Proc, check_ok, train_losses

from accel_train.config.checks import validate
from accel_train.config.run_config import resolve
from accel_train.errors import UserError
from accel_train.launchers.world import check_strategy

TIMEOUT = 420  # seconds for one run while the other runs share the two cores
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))
STEPS = 20

COMMON = [
    "+experiment=gpt_char",
    "dataset.path=../tokens",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_embd=32",
    "model.block_size=16",
    "dataset.windows_per_epoch=1600",
    "dataset.eval_windows=16",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=1.0",
    "trainer.gradient_clip_val=0.5",
    "trainer.deterministic=true",
    "trainer.seed=3",
    "trainer.progress=none",
    "trainer.plot_curves=false",
    "scheduler.warmup_steps=2",
    "precision=fp32",
    "logger=none",
]


def assert_same_trajectory(a: dict[int, float], b: dict[int, float]) -> None:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), (step, a, b)


@pytest.fixture(scope="module")
def root(tmp_path_factory, run_cli_in):
    """A folder holding `tokens` (tokenized once for the module's runs)."""
    root = tmp_path_factory.mktemp("tp")
    (root / "input.txt").write_text(TEXT)
    check_ok(run_cli_in(["tokenize", "input=input.txt", "out=tokens"], root, prog="accel-data"))
    return root


@pytest.fixture(scope="module")
def runs(root):
    work = root / "work"
    procs = {
        "one": Proc([*COMMON, "loader.batch_size=8", "hydra.run.dir=one"], work, "one"),
        "tp": Proc(
            [
                *COMMON,
                "strategy=tp",
                "launcher.nproc_per_node=2",
                "loader.batch_size=8",
                "hydra.run.dir=tp",
            ],
            work,
            "tp",
        ),
        # 2-way FSDP x 2-way TP: 4 per FSDP rank x 2 = the reference's 8.
        "fsdp_tp": Proc(
            [
                *COMMON,
                "strategy=fsdp",
                "strategy.tp=2",
                "launcher.nproc_per_node=4",
                "loader.batch_size=4",
                "hydra.run.dir=fsdp_tp",
            ],
            work,
            "fsdp_tp",
        ),
    }
    yield work, procs
    for proc in procs.values():
        proc.kill()


def test_tp_over_two_processes_matches_one_process(runs):
    work, procs = runs
    out = procs["tp"].ok()
    procs["one"].ok()
    assert "tensor parallel over 2 processes: 12 modules" in out
    assert "x 1 process(es) = 8 global" in out  # the two TP ranks read the same batches
    assert_same_trajectory(train_losses(work / "one"), train_losses(work / "tp"))
    assert (work / "tp" / "checkpoints" / "last.dcp" / ".metadata").is_file()


def test_fsdp_times_tp_matches_one_process(runs):
    work, procs = runs
    out = procs["fsdp_tp"].ok()
    procs["one"].ok()
    assert "tensor parallel over 2 processes" in out
    assert "x 2 process(es) = 8 global" in out
    assert_same_trajectory(train_losses(work / "one"), train_losses(work / "fsdp_tp"))


def test_sequence_parallel_and_the_working_techniques_train(root, tmp_path, run_cli):
    """Sequence parallelism, activation checkpointing, EMA, accumulation and bf16 autocast
    together under TP: the run trains and its loss falls."""
    args = [a for a in COMMON if a != "dataset.path=../tokens" and not a.startswith("precision")]
    proc = run_cli(
        [
            *args,
            f"dataset.path={root / 'tokens'}",
            "strategy=tp",
            "strategy.sequence_parallel=true",
            "launcher.nproc_per_node=2",
            "loader.batch_size=4",
            "activation_checkpointing.mode=full",
            "ema.enabled=true",
            "trainer.accumulate_grad_batches=2",
            "precision=bf16",
            "hydra.run.dir=run",
        ],
        timeout=TIMEOUT,
    )
    check_ok(proc)
    assert "SequenceParallel" in proc.stderr
    curve = train_losses(tmp_path / "run")
    assert len(curve) == STEPS and curve[STEPS] < curve[1]


@pytest.mark.parametrize(
    ("overrides", "nproc", "said"),
    [
        (["strategy=tp", "model.n_head=3", "model.n_embd=24"], 2, "strategy.tp=2 does not divide"),
        (["strategy=fsdp", "strategy.tp=2"], 3, "strategy.tp=2 does not divide the 3 processes"),
        (["strategy=tp", "strategy.tp=2"], 4, "strategy=fsdp strategy.tp=2"),
        (["strategy=tp", "lora.rank=2"], 2, "lora.rank with strategy=tp"),
        (["strategy=fsdp", "strategy.tp=2", "precision=fp16"], 2, "precision=fp16 with tensor"),
    ],
)
def test_impossible_layouts_are_refused_before_any_process_starts(
    overrides, nproc, said, compose_cfg, tmp_path
):
    """The launcher's checks (validate, then the layout for `nproc` processes): one paragraph
    that names the key and the way out."""
    cfg = compose_cfg(
        [
            *COMMON,
            *overrides,
            f"launcher.nproc_per_node={nproc}",
            f"paths.output_dir={tmp_path}",
        ]
    )
    with pytest.raises(UserError) as refused:
        validate(cfg)
        check_strategy(resolve(cfg), nproc)
    message = str(refused.value)
    assert said in message and "`" in message and "\n" not in message


# The built-in MLP (784 -> 512 -> 256 -> 10, in-place ReLUs): 4 steps, dropout off.
MLP = [
    "model=mlp",
    "model.dropout=0",
    "dataset=synthetic",
    "dataset.num_train=256",
    "dataset.num_test=64",
    "dataset.val_fraction=0",
    "loader.batch_size=32",
    "precision=fp32",
    "trainer.deterministic=true",
    "trainer.seed=3",
    "trainer.log_every_n_steps=1",
    "trainer.max_steps=4",
    "trainer.gradient_clip_val=0.5",
    "trainer.progress=none",
    "trainer.plot_curves=false",
    "logger=none",
]


def test_a_builtin_mlp_trains_under_tp_with_the_plan_its_refusal_gives(tmp_path, run_cli):
    """A model with no plan of its own is refused, with a `strategy.tp_plan` override for its
    Linear layers that a shell and Hydra parse as given; run as given, it trains (the MLP's
    in-place ReLUs run out of place on the sharded activations) and follows one process."""
    tp = [*MLP, "strategy=tp", "launcher.nproc_per_node=2"]
    refused = run_cli([*tp, "hydra.run.dir=refused"], timeout=TIMEOUT)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "declares no plan of its own" in refused.stderr
    example = re.search(r"`(\'\+strategy\.tp_plan=[^`]*)`", refused.stderr)
    assert example, refused.stderr[-3000:]
    (plan,) = shlex.split(example.group(1))  # as a shell passes it
    assert plan == "+strategy.tp_plan={1: colwise, 4: rowwise}"
    proc = run_cli([*tp, plan, "hydra.run.dir=tp"], timeout=TIMEOUT)
    check_ok(proc)
    assert "tensor parallel over 2 processes: 2 modules" in proc.stdout + proc.stderr
    check_ok(run_cli([*MLP, "hydra.run.dir=one"]))
    one, sharded = train_losses(tmp_path / "one"), train_losses(tmp_path / "tp")
    assert sorted(one) == sorted(sharded) == [1, 2, 3, 4]
    for step in one:
        assert sharded[step] == pytest.approx(one[step], rel=1e-4), (step, one, sharded)


def test_heads_not_divisible_is_refused_by_the_cli(run_cli, tmp_path):
    proc = run_cli(
        [
            *COMMON,
            "strategy=tp",
            "launcher.nproc_per_node=2",
            "model.n_head=3",
            "model.n_embd=24",
            "hydra.run.dir=run",
        ]
    )
    assert proc.returncode != 0
    assert "strategy.tp=2 does not divide model.n_head=3" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()  # refused before torchrun started
