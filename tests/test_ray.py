"""launcher=ray on a real Ray cluster: a head on 127.0.0.1 that this module starts (token
authentication on, as current Ray does by default) and stops by its process id, shared by the
module's tests. Every run is the real `accel-train` in a subprocess, as a user starts it.

The 2-worker DDP run through Ray Train matches the same run under torchrun (summary, metrics,
checkpoints); a run goes through the Jobs API and is followed with the command it prints; a
worker killed mid-run is restarted by Ray's FailureConfig and resumes from last.pt; and the
errors (no cluster at the address, a wrong token, Ray not installed, bad launcher values, a
failing worker) are one paragraph each, with the exit code that says so.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import BIN, free_port, read_jsonl
from ray_head import Head

# About Ray: its CLI runs start a new interpreter, never the warm parent
# (tests/warm_cli.py).
pytestmark = pytest.mark.fresh

TIMEOUT = 300  # seconds for one Ray run on two shared cores (Ray's own start-up is ~20 s)

# Tiny and deterministic: 8 steps of 2 x 16 (the same numbers under torchrun and Ray).
RUN = [
    "model=mlp",
    "dataset=synthetic",
    "dataset.num_train=250",
    "dataset.num_test=63",
    "dataset.val_fraction=0",
    "model.dropout=0",
    "precision=fp32",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "trainer.max_steps=8",
    "trainer.seed=3",
    "trainer.progress=none",
    "trainer.plot_curves=false",
    "strategy=ddp",
    "loader.batch_size=16",
]


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    started = Head(tmp_path_factory.mktemp("ray_head"))
    yield started
    started.stop()


def accel_train(head: Head, args: list[str], cwd: Path, env: dict | None = None, **popen):
    cwd.mkdir(parents=True, exist_ok=True)
    cmd = [str(BIN / "accel-train"), *[str(a) for a in args]]
    return subprocess.Popen(cmd, cwd=cwd, env={**head.env, **(env or {})}, text=True, **popen)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, out


def run(head: Head, args: list[str], cwd: Path, env: dict | None = None) -> tuple[int, str]:
    proc = accel_train(head, args, cwd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return finish(proc)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def series(run_dir: Path, key: str) -> dict[int, float]:
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if key in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"{key} logged twice for a step: {steps}"
    return {r["step"]: r[key] for r in rows}


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


# ---- the same DDP run under torchrun and through Ray Train ---------------------------------


def test_ray_ddp_run_matches_the_same_run_under_torchrun(head, tmp_path):
    torchrun_dir, ray_dir = tmp_path / "torchrun", tmp_path / "ray"
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    under_torchrun = accel_train(
        head,
        [*RUN, "launcher.nproc_per_node=2", f"hydra.run.dir={torchrun_dir}"],
        tmp_path,
        **pipe,
    )
    code, out = run(
        head,
        [
            *RUN,
            "launcher=ray",
            "launcher.num_workers=2",
            f"launcher.address={head.address}",
            f"hydra.run.dir={ray_dir}",
        ],
        tmp_path / "cwd",  # another folder: every path the workers get is absolute
    )
    assert code == 0, out[-5000:]
    torchrun_code, torchrun_out = finish(under_torchrun)
    assert torchrun_code == 0, torchrun_out[-5000:]
    # One verdict: the "done" line once (global rank 0), no failure, exit 0 (above).
    assert out.count("done: 8 steps") == 1, out[-3000:]
    assert "RayTrainWorker" in out  # the workers were Ray's
    # One run dir written once: one config.yaml, one summary.json, one set of checkpoints.
    assert [p.parent for p in tmp_path.rglob("summary.json")].count(ray_dir) == 1
    assert not list((tmp_path / "cwd").rglob("summary.json"))
    mine, ref = summary(ray_dir), summary(torchrun_dir)
    for key in ("steps", "epochs", "world_size", "global_batch", "monitor"):
        assert mine[key] == ref[key], key
    assert (mine["world_size"], mine["steps"], mine["global_batch"]) == (2, 8, 32)
    for key in ("best_val_acc", "final_val_loss", "final_val_acc", "test_acc"):
        assert mine[key] == pytest.approx(ref[key], rel=1e-5), key
    assert series(ray_dir, "train/loss") == pytest.approx(series(torchrun_dir, "train/loss"))
    names = sorted(p.name for p in (ray_dir / "checkpoints").iterdir())
    assert names == sorted(p.name for p in (torchrun_dir / "checkpoints").iterdir())
    for name in names:
        a, b = weights(ray_dir / "checkpoints" / name), weights(torchrun_dir / "checkpoints" / name)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=f"{name} {key}")


# ---- the Jobs API ----------------------------------------------------------------------------


def test_a_run_submitted_through_the_jobs_api_runs_and_is_followed(head, tmp_path):
    run_dir = tmp_path / "job"
    code, out = run(
        head,
        [
            *RUN,
            "launcher=ray",
            "launcher.num_workers=2",
            f"launcher.address={head.jobs_address}",
            "launcher.submit=job",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    assert code == 0, out[-5000:]
    assert "submitted Ray job raysubmit_" in out, out[-3000:]
    # The command it prints to follow the job, run as printed: it ends when the job does.
    follow = next(line for line in out.splitlines() if "follow:" in line)
    argv = shlex.split(follow.split("follow:", 1)[1])
    assert argv[:3] == ["ray", "job", "logs"], follow
    logs = subprocess.run(
        [str(BIN / "ray"), *argv[1:]],
        env=head.env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert "succeeded" in logs.stdout + logs.stderr, (logs.stdout + logs.stderr)[-4000:]
    assert "done: 8 steps" in logs.stdout + logs.stderr
    s = summary(run_dir)
    assert (s["world_size"], s["steps"], s["global_batch"]) == (2, 8, 32)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best.pt", "last.pt"]


# ---- a worker killed mid-run: restarted, resumed -------------------------------------------

KILL_CKPT_EVERY, KILL_STEPS = 2, 64  # 1024 samples / 2 workers / 8 per batch = 64 steps


def test_a_killed_worker_restarts_and_resumes_from_last_checkpoint(head, tmp_path):
    run_dir = tmp_path / "run"
    args = [
        *[a for a in RUN if not a.startswith(("trainer.max_steps", "dataset.num_train"))],
        "dataset.num_train=1024",
        "loader.batch_size=8",
        "trainer.max_epochs=1",
        f"trainer.ckpt_every_n_steps={KILL_CKPT_EVERY}",
        "launcher=ray",
        "launcher.num_workers=2",
        "launcher.max_failures=1",
        f"launcher.address={head.address}",
        f"hydra.run.dir={run_dir}",
    ]
    args = [a for a in args if a != "loader.batch_size=16"]
    proc = accel_train(head, args, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    killed: list[int] = []

    def kill_after_first_checkpoint() -> None:
        deadline = time.monotonic() + TIMEOUT
        while not (run_dir / "checkpoints" / "last.pt").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.02)
        workers = head.train_workers()
        if workers:
            os.kill(workers[0], signal.SIGKILL)
            killed.append(workers[0])

    killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
    killer.start()
    code, out = finish(proc)
    killer.join()
    assert killed, "the run ended before its first checkpoint"
    assert code == 0, out[-5000:]
    assert summary(run_dir)["steps"] == KILL_STEPS
    rows = read_jsonl(run_dir / "metrics.jsonl")
    resumes = [i for i, r in enumerate(rows) if r.get("event") == "resume"]
    assert len(resumes) == 1, "the run finished before the kill, or restarted twice"
    resumed_at = rows[resumes[0]]["step"]
    assert rows[resumes[0]]["from"] == str(run_dir / "checkpoints" / "last.pt")
    assert resumed_at > 0 and resumed_at % KILL_CKPT_EVERY == 0
    trained = max(r["step"] for r in rows[: resumes[0]] if "train/loss" in r)
    assert trained - resumed_at <= KILL_CKPT_EVERY  # at most one checkpoint interval lost
    after = [r["step"] for r in rows[resumes[0] :] if "train/loss" in r]
    assert after == list(range(resumed_at + 1, KILL_STEPS + 1))
    assert out.count(f"done: {KILL_STEPS} steps") == 1


# ---- errors: one paragraph each ------------------------------------------------------------


def assert_one_paragraph(code: int, out: str, *texts: str) -> None:
    assert code == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    error = out[out.index("accel-train: error:") :]
    for text in texts:
        assert text in error, (text, error)


def test_a_wrong_token_is_one_paragraph(head, tmp_path):
    code, out = run(
        head,
        [*RUN, "launcher=ray", f"launcher.address={head.address}", f"hydra.run.dir={tmp_path}/r"],
        tmp_path,
        env={"RAY_AUTH_TOKEN": "0" * 32},
    )
    assert_one_paragraph(code, out, f"launcher.address={head.address}", "RAY_AUTH_TOKEN")
    assert not (tmp_path / "r" / "summary.json").exists()


def test_a_failing_worker_fails_the_run_with_its_message(head, tmp_path):
    """The verdict is never wrong the other way: a worker's error fails the run (exit 2)."""
    code, out = run(
        head,
        [
            *[a for a in RUN if not a.startswith("dataset.")],
            "dataset=mnist",  # no data there: the workers' data loading refuses
            "launcher=ray",
            f"launcher.address={head.address}",
            f"hydra.run.dir={tmp_path}/r",
        ],
        tmp_path,
    )
    assert_one_paragraph(code, out, "the Ray workers failed", "no-data-here")
    assert not (tmp_path / "r" / "summary.json").exists()


BAD_LAUNCHER = {
    "nothing_there": (["launcher.address=127.0.0.1:{closed}"], ["launcher.address", "refused"]),
    "jobs_without_http": (
        ["launcher.submit=job", "launcher.address=127.0.0.1:6379"],
        ["launcher.submit=job", "http://head:8265"],
    ),
    "http_without_job": (
        ["launcher.address=http://127.0.0.1:8265"],
        ["launcher.address=http://127.0.0.1:8265", "launcher.submit=job"],
    ),
    "no_workers": (["launcher.num_workers=0"], ["launcher.num_workers=0"]),
    # The strategy's refusal names Ray's own key and the user's value.
    "single_with_workers": (
        ["strategy=single", "launcher.num_workers=3"],
        ["launcher.num_workers=3", "launcher.num_workers=1"],
    ),
    # GPUs the cluster does not have: refused once connected, before Ray Train waits forever.
    "gpus_the_cluster_lacks": (
        ["launcher.use_gpu=true", "launcher.address={address}"],
        ["launcher.use_gpu=true", "2 GPU", "has 0 GPU", "launcher.use_gpu=false"],
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_LAUNCHER))
def test_bad_launcher_values_are_one_paragraph(name, head, tmp_path):
    args, texts = BAD_LAUNCHER[name]
    places = {"closed": free_port(), "address": head.address}
    keys = {a.split("=")[0] for a in args}
    code, out = run(
        head,
        [
            *[a for a in RUN if a.split("=")[0] not in keys],
            "launcher=ray",
            *(a.format(**places) for a in args),
            f"hydra.run.dir={tmp_path}/r",
        ],
        tmp_path,
    )
    assert_one_paragraph(code, out, *(t.format(**places) for t in texts))


def test_ray_not_installed_is_one_paragraph(head, tmp_path):
    """The real CLI in a Python where `import ray` fails, as where the extra is not installed."""
    script = (
        "import sys; sys.modules['ray'] = None; sys.argv[0] = 'accel-train'\n"
        "from accel_train.cli import main; main()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *RUN, "launcher=ray", f"hydra.run.dir={tmp_path}/r"],
        cwd=tmp_path,
        env=head.env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert_one_paragraph(
        proc.returncode, proc.stdout + proc.stderr, "launcher=ray", "pip install 'accel-train[ray]'"
    )
