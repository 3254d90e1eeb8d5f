"""loader=ray through the real CLI, on a Ray head of this module's own (127.0.0.1, a 100 MB
object store, started once and stopped by its process id: tests/ray_head.py).

- The batches are loader=torch's: the final weights and losses are bit-identical on a generated
  JPEG folder (with per-sample RandAugment, mixup and random erasing on) and on MNIST.
- A data worker SIGKILLed mid-epoch (found by its process title, ray::AccelTrainDataWorker)
  changes nothing: its batches are made again by the other worker.
- Losing every data worker (one worker, no restarts) stops the run with one paragraph and a
  mid-epoch last.pt; the rerun resumes from it and ends with the uninterrupted run's weights.
- What cannot travel to the workers is refused by name: an unpicklable data set, a streaming
  split, dataset.decode=gpu.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import BIN, read_jsonl
from ray_head import Head
from test_image_folder import write_image_folder

# About Ray: its CLI runs start a new interpreter, never the warm parent
# (tests/warm_cli.py).
pytestmark = pytest.mark.fresh

TIMEOUT = 240
REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"  # ../shared/data: MNIST (5,000 training images)
WORKER_TITLE = b"ray::AccelTrainDataWorker"

COMMON = [
    "trainer.deterministic=true",
    "trainer.progress=none",
    "trainer.plot_curves=false",
    "trainer.log_every_n_steps=1",
    "logger=none",
    "precision=fp32",
]
FOLDER = [
    "dataset=image_folder",
    "dataset.image_size=32",
    "dataset.auto_augment=rand-m9-mstd0.5-inc1",  # per-sample, in the loader: seeded per item
    "dataset.mixup_alpha=0.8",  # per batch, on the device
    "dataset.random_erasing=0.25",
    "model=mnist_cnn",
    "loader.batch_size=8",
    "trainer.max_epochs=2",  # the second epoch's draws differ from the first's
]
MNIST_STEPS = 120
MNIST = [
    "dataset=mnist",
    f"paths.data_dir={SHARED_DATA}",
    "model=mlp",
    "loader.batch_size=16",
    f"trainer.max_steps={MNIST_STEPS}",
    "trainer.limit_val_batches=2",
    "trainer.test_after_fit=false",
]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    started = Head(tmp_path_factory.mktemp("ray_head"), object_store_mb=100)
    yield started
    started.stop()


def start(head: Head, args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [str(BIN / "accel-train"), *COMMON, *args],
        cwd=cwd,
        env={**head.env, **(env or {})},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, out


def ray_args(head: Head, *extra: str) -> list[str]:
    return ["loader=ray", f"loader.address={head.address}", *extra]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return ckpt["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def losses(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r["train/loss"]
        for r in read_jsonl(run_dir / "metrics.jsonl")
        if "train/loss" in r
    }


def kill_a_worker_at(head: Head, run_dir: Path, proc, step: int, killed: list[int]) -> None:
    """SIGKILL one data worker once the run has logged training step `step` (mid-epoch)."""
    deadline = time.monotonic() + TIMEOUT
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None and time.monotonic() < deadline:
        rows = read_jsonl(metrics) if metrics.exists() else []
        if any(r.get("step", 0) >= step and "train/loss" in r for r in rows):
            workers = head.titled(WORKER_TITLE)
            if workers:
                os.kill(workers[0], signal.SIGKILL)
                killed.append(workers[0])
                return
        time.sleep(0.01)


def run_with_a_kill(head: Head, args: list[str], run_dir: Path, at_step: int):
    proc = start(head, [*args, f"hydra.run.dir={run_dir}"], run_dir.parent)
    killed: list[int] = []
    killer = threading.Thread(target=kill_a_worker_at, args=(head, run_dir, proc, at_step, killed))
    killer.start()
    code, out = finish(proc)
    killer.join()
    assert killed, f"no data worker was killed (exit {code})\n{out[-3000:]}"
    return code, out


UNPICKLABLE = """
import threading

import torch
from torch.utils.data import Dataset


class Locked(Dataset):
    def __init__(self, n):
        self.lock = threading.Lock()  # what pickle cannot carry
        self.x = torch.zeros(n, 1, 8, 8, dtype=torch.uint8)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i % 2


def build(seed=0):
    return Locked(40), Locked(8)
"""


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """The runs that need no Ray head, started before it (most of a run is importing torch):
    the loader=torch references and the refusals. name -> Future of (run dir, exit code, out)."""
    root = tmp_path_factory.mktemp("ray_loader")
    folder = write_image_folder(root / "data", 12, 4, seed=2)
    (root / "locked_data.py").write_text(textwrap.dedent(UNPICKLABLE))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    jobs = {
        "folder": [*FOLDER, f"dataset.root={folder}"],
        "mnist": MNIST,
        # (refused before any Ray starts: no address)
        "unpicklable": ["loader=ray", "dataset=custom", "dataset._target_=locked_data.build"],
        "decode_gpu": [
            "loader=ray",
            "dataset=image_folder",
            f"dataset.root={folder}",
            "dataset.decode=gpu",
        ],
        # Shards written first (below): a streaming split is read in an order of its own.
        "streaming": ["loader=ray", "dataset=streaming", f"dataset.remote={root / 'shards'}"],
    }

    def run(name: str):
        run_dir = root / name / "run"
        if name == "streaming":
            shard = ["dataset=image_folder", f"dataset.root={folder}", f"out={root / 'shards'}"]
            made = subprocess.run(
                [str(BIN / "accel-data"), "shard", *shard], cwd=root, env=env, capture_output=True
            )
            assert made.returncode == 0, made.stderr[-3000:]
        proc = subprocess.Popen(
            [str(BIN / "accel-train"), *COMMON, *jobs[name], f"hydra.run.dir={run_dir}"],
            cwd=root,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        return (run_dir, *finish(proc))

    pool = ThreadPoolExecutor(2)
    futures = {name: pool.submit(run, name) for name in jobs}
    futures["folder_root"] = folder
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def reference(local_runs, name: str) -> Path:
    run_dir, code, out = local_runs[name].result()
    assert code == 0, out[-4000:]
    return run_dir


# ---- bit-identical to loader=torch ----------------------------------------------------------


def test_image_folder_batches_weights_and_losses_match_loader_torch(local_runs, head, tmp_path):
    ray_dir = tmp_path / "run"
    args = [*FOLDER, f"dataset.root={local_runs['folder_root']}", *ray_args(head)]
    code, out = finish(start(head, [*args, f"hydra.run.dir={ray_dir}"], tmp_path))
    assert code == 0, out[-4000:]
    assert "accel-train-data-0-0" in out and "accel-train-data-0-1" in out, out[-3000:]
    torch_dir = reference(local_runs, "folder")
    assert losses(ray_dir) == losses(torch_dir)
    assert len(losses(ray_dir)) >= 8
    assert_same_weights(ray_dir, torch_dir)
    # The remote pool's figures at the logging steps.
    rows = [r for r in read_jsonl(ray_dir / "metrics.jsonl") if "data/remote_images_per_s" in r]
    assert rows and all(r["data/remote_images_per_s"] > 0 for r in rows)
    assert all(r["data/remote_busy_share"] > 0 for r in rows), rows
    # A loop that waited on its data more than 20 % of its time says so at the end, with the
    # remedy: loader=ray for a local loader, more Ray workers for loader=ray.
    for run, fix in ((ray_dir, "more Ray data workers"), (torch_dir, "`loader=ray`")):
        said = [
            line for line in (run / "train.log").read_text().splitlines() if "waited for" in line
        ]
        if json.loads((run / "summary.json").read_text())["data_wait_share"] > 0.2:
            assert said and fix in said[0], (run, said)
        else:
            assert not said, said


@pytest.fixture(scope="module")
def lost_pool(head, tmp_path_factory):
    """MNIST under loader=ray with one worker and no restarts, its worker killed at step 5."""
    run_dir = tmp_path_factory.mktemp("lost") / "run"
    fragile = ray_args(head, "loader.num_workers=1", "loader.max_restarts=0", "loader.retries=0")
    code, out = run_with_a_kill(head, [*MNIST, *fragile], run_dir, 5)
    last = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    return run_dir, code, out, last["progress"]


def test_losing_every_worker_is_one_paragraph_and_a_mid_epoch_checkpoint(lost_pool):
    run_dir, code, out, stopped = lost_pool
    assert code == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    error = out[out.index("accel-train: error:") :]
    assert "loader=ray" in error and "loader.retries=0" in error, error
    assert f"resume=auto hydra.run.dir={run_dir}" in error, error
    assert 5 <= stopped["step"] == stopped["batch_in_epoch"] < MNIST_STEPS  # mid-epoch


def test_resumed_with_a_worker_killed_mid_epoch_the_weights_are_the_uninterrupted_ones(
    local_runs, head, lost_pool
):
    """The rerun the message asks for continues mid-epoch from last.pt; one of its two workers
    is SIGKILLed 5 steps later. Neither changes a bit of the final weights or any loss."""
    run_dir, _, _, stopped = lost_pool
    again = [*MNIST, *ray_args(head), "resume=auto"]
    code, out = run_with_a_kill(head, again, run_dir, stopped["step"] + 5)
    assert code == 0, out[-4000:]
    assert f"at epoch 0, step {stopped['step']}" in out, out[-3000:]
    assert "died" in out and "its batch goes to" in out, out[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert max(r.get("data/resubmitted", 0) for r in rows) >= 1
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, MNIST_STEPS + 1))
    mnist_torch = reference(local_runs, "mnist")
    assert losses(run_dir) == losses(mnist_torch)
    assert_same_weights(run_dir, mnist_torch)


# ---- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, texts",
    [
        ("unpicklable", ["loader=ray", "Locked split cannot be pickled", "loader=torch"]),
        ("decode_gpu", ["dataset.decode=gpu with loader=ray", "dataset.decode=cpu"]),
        ("streaming", ["loader=ray", "read in an order of its own", "loader=torch"]),
    ],
)
def test_what_cannot_travel_is_refused_by_name(local_runs, name, texts):
    _, code, out = local_runs[name].result()
    assert code == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    error = out[out.index("accel-train: error:") :]
    for text in texts:
        assert text in error, (text, error)
    assert "Ray instance" not in out and "data workers on" not in out  # no Ray was started
