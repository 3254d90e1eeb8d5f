"""Checkpoints move between strategies and world sizes (issue 29): a run stopped at an epoch end
under one strategy resumes under another and continues exactly as one uninterrupted process
(the same global batch of 8, so the same loss trajectory, fp32, within 1e-4); accel-sample
and accel-export read the sharded kinds. docs/distributed.md's table lists these
pairs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import check_ok

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))

COMMON = [
    "+experiment=gpt_char",
    "dataset.path=tokens",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_embd=32",
    "model.block_size=16",
    "dataset.windows_per_epoch=80",  # 10 steps of 8 an epoch: the sources stop at an epoch end
    "dataset.eval_windows=16",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=1.0",
    "trainer.deterministic=true",
    "trainer.seed=3",
    "trainer.progress=none",
    "trainer.plot_curves=false",
    "scheduler.warmup_steps=0",
    "scheduler.min_lr=0.001",  # = optimizer.lr: one lr whether a run is planned for 10 or 20 steps
    "precision=fp32",
    "logger=none",
]
# strategy -> its overrides for a global batch of 8.
STRATEGIES = {
    "single": ["loader.batch_size=8"],
    "ddp": ["strategy=ddp", "launcher.nproc_per_node=2", "loader.batch_size=4"],
    "fsdp": ["strategy=fsdp", "launcher.nproc_per_node=2", "loader.batch_size=4"],
    "tp": ["strategy=tp", "launcher.nproc_per_node=2", "loader.batch_size=8"],
    "fsdp_tp": [
        "strategy=fsdp",
        "strategy.tp=2",
        "launcher.nproc_per_node=4",
        "loader.batch_size=4",
    ],
}
# (written under, resumed under): every format change and a world-size change.
PAIRS = [
    ("single", "tp"),  # last.pt cut into TP shards
    ("tp", "single"),  # last.dcp consolidated into one process
    ("fsdp", "fsdp_tp"),  # sharded -> sharded, 2 -> 4 processes
    ("fsdp", "ddp"),  # sharded -> one file, 2 processes each
    ("ddp", "fsdp_tp"),  # one file -> FSDP x TP over 4
]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def _suffix(strategy: str) -> str:
    return ".pt" if strategy in ("single", "ddp") else ".dcp"


@pytest.fixture(scope="module")
def root(tmp_path_factory, run_cli_in) -> Path:
    """The tokens, the uninterrupted reference (20 steps) and one 10-step source per strategy."""
    root = tmp_path_factory.mktemp("moves")
    (root / "input.txt").write_text(TEXT)
    check_ok(run_cli_in(["tokenize", "input=input.txt", "out=tokens"], root, prog="accel-data"))
    check_ok(
        run_cli_in(
            [*COMMON, *STRATEGIES["single"], "trainer.max_steps=20", "hydra.run.dir=ref"], root
        )
    )
    for name in sorted({a for a, _ in PAIRS}):
        args = [*COMMON, *STRATEGIES[name], "trainer.max_steps=10", f"hydra.run.dir=src_{name}"]
        check_ok(run_cli_in(args, root, timeout=300))
    return root


@pytest.mark.parametrize(("source", "target"), PAIRS)
def test_a_checkpoint_resumes_under_another_strategy(source, target, root, run_cli_in):
    ckpt = root / f"src_{source}" / "checkpoints" / f"last{_suffix(source)}"
    assert ckpt.exists()
    run = f"{source}_to_{target}"
    proc = run_cli_in(
        [
            *COMMON,
            *STRATEGIES[target],
            "trainer.max_steps=20",
            f"resume={ckpt}",
            f"hydra.run.dir={run}",
        ],
        root,
        timeout=300,
    )
    check_ok(proc)
    log = proc.stdout + proc.stderr
    assert f"resumed from {ckpt} at epoch 1, step 10" in log
    ref, resumed = _losses(root / "ref"), _losses(root / run)
    assert sorted(resumed) == list(range(11, 21))
    for step in resumed:
        assert resumed[step] == pytest.approx(ref[step], rel=1e-4), (step, ref, resumed)
    assert (root / run / "checkpoints" / f"last{_suffix(target)}").exists()


def test_a_mid_epoch_tp_checkpoint_is_refused_naming_its_data_parallel_ranks(root, run_cli_in):
    """A TP run's 2 processes are 1 data-parallel rank: resumed mid-epoch under DDP over 2
    processes (2 ranks), the refusal says so, before any process starts. The TP source stopped
    at an epoch end; its meta.pt is moved 5 batches into the next epoch."""
    ckpt = root / "mid_tp" / "checkpoints" / "last.dcp"
    shutil.copytree(root / "src_tp" / "checkpoints" / "last.dcp", ckpt)
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    meta["progress"]["batch_in_epoch"] = 5
    torch.save(meta, ckpt / "meta.pt")
    ddp = ["strategy=ddp", "launcher.nproc_per_node=2", "loader.batch_size=8"]
    proc = run_cli_in(
        [*COMMON, *ddp, "trainer.max_steps=20", f"resume={ckpt}", "hydra.run.dir=mid_ddp"], root
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "was written by 1 data-parallel rank (2 processes, TP=2) in the middle of epoch 1" in (
        proc.stderr
    )
    assert "this run has 2 data-parallel ranks." in proc.stderr
    assert "Traceback" not in proc.stderr and not (root / "mid_ddp").exists()


SAMPLE = ["prompt=def", "max_new_tokens=12", "temperature=0"]


@pytest.fixture(scope="module")
def single_sample(root, run_cli_in) -> str:
    """accel-sample's greedy text from the single-process source (sampled once for both
    sharded kinds)."""
    one = root / "src_single" / "checkpoints" / "last.pt"
    sample = run_cli_in([f"ckpt_path={one}", *SAMPLE], root, prog="accel-sample")
    check_ok(sample)
    return sample.stdout


@pytest.mark.parametrize("source", ["tp", "fsdp"])
def test_sample_and_export_read_sharded_checkpoints(source, root, single_sample, run_cli_in):
    """accel-sample and accel-export consolidate a sharded checkpoint into one process: greedy
    samples equal to those of the single-process checkpoint of the same trajectory, and an
    exported model that matches its PyTorch model."""
    ckpt = root / f"src_{source}" / "checkpoints" / "last.dcp"
    sample = run_cli_in([f"ckpt_path={ckpt}", *SAMPLE], root, prog="accel-sample")
    check_ok(sample)
    texts = [sample.stdout, single_sample]
    assert texts[0] == texts[1] and "def" in texts[0]
    out = root / f"{source}.pt2"
    export = run_cli_in(
        [f"ckpt_path={ckpt}", "format=torch_export", f"out_path={out}"], root, prog="accel-export"
    )
    check_ok(export)
    assert out.stat().st_size > 0 and "max abs diff" in export.stdout + export.stderr


COUNT_READS = """
import sys
from pathlib import Path
from accel_train import checkpoint
from accel_train.cli import main

original = checkpoint.load_checkpoint

def counted(path, *args, **kwargs):
    with open("reads.txt", "a") as f:  # (the CLI may leave by os._exit: written as it goes)
        f.write(Path(path).name + "\\n")
    return original(path, *args, **kwargs)

checkpoint.load_checkpoint = counted
sys.argv = ["accel-train", *sys.argv[1:]]
main()
"""


def test_a_resumed_run_reads_the_checkpoint_once(root):
    """The launch side (check_resume), the batch-size resolution and the loop's resume all
    read the checkpoint through train/found.py: one read of last.pt per run (one process)."""
    ckpt = root / "src_single" / "checkpoints" / "last.pt"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            COUNT_READS,
            *COMMON,
            *STRATEGIES["single"],
            "trainer.max_steps=12",
            f"resume={ckpt}",
            "hydra.run.dir=read_once",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reads = (root / "reads.txt").read_text().split()
    assert reads.count("last.pt") == 1, reads
