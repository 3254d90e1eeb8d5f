"""checkpoint.async_save=true through the real CLI (issue 29): the blocked time is logged per
save, and SIGKILLs at random moments while saves are in flight (a checkpoint every step) never
leave a half-written checkpoint that a resume would load: every resume continues from the last
complete one, and the run ends at its length."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import BIN, check_ok, read_jsonl, wait_for

from accel_train.checkpoint import load_checkpoint

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))
MAX_STEPS = 200  # long enough that no kill lands after the end (saves every step are fast)

COMMON = [
    "+experiment=gpt_char",
    "dataset.path=tokens",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_embd=32",
    "model.block_size=16",
    "loader.batch_size=8",
    "dataset.windows_per_epoch=1600",
    "dataset.eval_windows=16",
    f"trainer.max_steps={MAX_STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=20",
    "trainer.ckpt_every_n_steps=1",  # a save in flight almost all the time
    "trainer.progress=none",
    "trainer.plot_curves=false",
    "scheduler.warmup_steps=2",
    "precision=fp32",
    "logger=none",
    "checkpoint.async_save=true",
    "checkpoint.save_top_k=2",
    "resume=auto",
]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory, run_cli_in) -> Path:
    root = tmp_path_factory.mktemp("async")
    (root / "input.txt").write_text(TEXT)
    check_ok(run_cli_in(["tokenize", "input=input.txt", "out=tokens"], root, prog="accel-data"))
    return root


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [str(BIN / "accel-train"), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line]
    return max(steps, default=0)


def _kill_all(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the run as a crashed node would die: the launcher's process group and the
    workers torchrun starts in sessions of their own (their command line names the run dir)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    needle = f"{run_dir}/".encode()

    def strays() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # exited meanwhile
                continue
        return found

    for pid in strays():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not strays(), 60, "the killed workers to be gone")


def _reached(proc: subprocess.Popen, run_dir: Path, step: int) -> bool:
    assert proc.poll() is None, proc.communicate()[0][-4000:]  # still training
    return _last_step(run_dir) >= step


def _complete(ckpt_dir: Path) -> dict[str, int]:
    """Every checkpoint under its own name loads whole: its step."""
    steps = {}
    for entry in ckpt_dir.iterdir():
        if entry.name.startswith("."):
            continue  # a killed save's temp: never loaded (cleared on the next start)
        meta = entry / "meta.pt" if entry.is_dir() else entry
        if entry.is_dir():
            assert (entry / ".metadata").is_file(), entry
        steps[entry.name] = load_checkpoint(meta)["progress"]["step"]
    return steps


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("single", []),  # last.pt: a CPU copy written by a background thread
        ("tp", ["strategy=tp", "launcher.nproc_per_node=2"]),  # last.dcp: dcp.async_save
    ],
)
def test_sigkill_during_async_saves_resumes_from_a_complete_checkpoint(name, extra, tokens):
    rng = random.Random(29)
    run_dir = tokens / name
    args = [*COMMON, *extra, f"hydra.run.dir={name}"]
    for kill in range(2):
        proc = _start(args, tokens)
        reached = _last_step(run_dir) + 3 + rng.randrange(6)
        wait_for(lambda r=reached, p=proc: _reached(p, run_dir, r), 240, f"step {reached}")
        time.sleep(rng.uniform(0.0, 0.3))
        _kill_all(proc, run_dir)
        steps = _complete(run_dir / "checkpoints")
        assert steps["last" + (".dcp" if extra else ".pt")] <= _last_step(run_dir), (kill, steps)
    proc = _start(args, tokens)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-6000:]
    resumed = re.search(r"resumed from \S+ at epoch \d+, step (\d+)", out)
    assert resumed is not None, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == MAX_STEPS
    rows = read_jsonl(run_dir / "metrics.jsonl")
    blocked = [r["checkpoint/blocked_s"] for r in rows if "checkpoint/blocked_s" in r]
    assert blocked and all(b >= 0 for b in blocked)
    assert any("checkpoint/waited_s" in r for r in rows)
    assert max(_complete(run_dir / "checkpoints").values()) == MAX_STEPS


BN_NET = """
import torch
from torch import nn


class Net(nn.Module):  # BatchNorm: buffers that every forward pass changes
    def __init__(self, in_channels=1, image_size=28, num_classes=10):
        super().__init__()
        # Ballast: every step changes all of it, and its copy takes longer than a step of the
        # rest, so a copy that raced the next step would differ.
        self.ballast = nn.Parameter(torch.zeros(4_000_000))
        self.body = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * image_size * image_size, 32),
            nn.BatchNorm1d(32),
            nn.ReLU(),
            nn.Linear(32, num_classes),
        )

    def forward(self, x):
        return self.body(x) + self.ballast.mean()
"""


def test_async_checkpoints_equal_synchronous_ones(run_cli, tmp_path):
    """The background copy overlaps the next step's forward and backward: what that pass
    changes (BatchNorm's running statistics) is copied before the save returns, and the weights
    and the optimizer state before the next optimizer step changes them. Every checkpoint a
    run keeps (one per validation, training going on after each) equals the synchronous run's,
    tensor for tensor."""
    (tmp_path / "bnnet.py").write_text(BN_NET)
    runs = {}
    for mode in ("false", "true"):
        check_ok(
            run_cli(
                [
                    "model=custom",
                    "model._target_=bnnet.Net",
                    "dataset.num_train=256",
                    "dataset.num_test=64",
                    "loader.batch_size=16",
                    "trainer.max_steps=12",
                    "trainer.val_check_interval=3",
                    "trainer.progress=none",
                    "trainer.plot_curves=false",
                    "checkpoint.save_top_k=-1",
                    "checkpoint.monitor=val/loss",
                    f"checkpoint.async_save={mode}",
                    f"hydra.run.dir=run_{mode}",
                ]
            )
        )
        ckpts = tmp_path / f"run_{mode}" / "checkpoints"
        runs[mode] = {p.name: load_checkpoint(p) for p in sorted(ckpts.glob("*.pt"))}
    assert runs["true"].keys() == runs["false"].keys()
    assert len(runs["true"]) >= 5, runs["true"].keys()  # 4 validations' files + last.pt
    for name, sync in runs["false"].items():
        done = runs["true"][name]
        assert done["progress"]["step"] == sync["progress"]["step"], name
        for part in ("model", "optimizer"):
            flat_sync, flat_async = _tensors(sync[part]), _tensors(done[part])
            assert flat_sync.keys() == flat_async.keys()
            for key, value in flat_sync.items():
                assert torch.equal(value, flat_async[key]), (name, part, key)
        assert any("running_mean" in k for k in sync["model"])


def _tensors(obj, prefix="") -> dict:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {
            k: v for key, val in obj.items() for k, v in _tensors(val, f"{prefix}/{key}").items()
        }
    if isinstance(obj, (list, tuple)):
        return {
            k: v for i, val in enumerate(obj) for k, v in _tensors(val, f"{prefix}/{i}").items()
        }
    return {}
