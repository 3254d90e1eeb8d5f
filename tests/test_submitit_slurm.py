"""`hydra/launcher=submitit_slurm` (Hydra's submitit plugin) on the real localhost SLURM that
scripts/slurm/local-cluster.sh starts: a two-job sweep and preempted jobs that submitit requeues
and that resume exactly from their last.pt (slow: `pytest -m slow`), and the errors a user can
cause. The signal rules and the hand-over to submitit's handler are checked in-process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    assert_same_weights,
    check_ok,
    read_jsonl,
    run_cli,
    slurm_job_field,
    wait_for,
)

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

from accel_train.errors import UserError  # noqa: E402
from accel_train.launchers.slurm_job import requeue_or_stop  # noqa: E402
from accel_train.train.signals import StopRequest  # noqa: E402

# One test process for all SLURM tests: they share the local cluster's queue (pytest-xdist).
# About SLURM: its CLI runs start a new interpreter, never the warm parent
# (tests/warm_cli.py).
pytestmark = [pytest.mark.xdist_group("slurm"), pytest.mark.fresh]

# Tiny jobs: the sweeps run on two shared cores.
TINY = [
    "model=mlp",
    "dataset=synthetic",
    "dataset.num_train=64",
    "dataset.num_test=32",
    "trainer.max_epochs=1",
    "trainer.progress=none",
]

SLOW_HOOK = """
import time
from accel_train.techniques import Technique

class Slow(Technique):
    def __init__(self, seconds=1.0):
        self.seconds = seconds

    def on_train_step_end(self, loop):
        time.sleep(self.seconds)
"""


def _cluster_partition() -> str | None:
    """The default partition of a usable local cluster (None: no SLURM here)."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return None
    out = subprocess.run(["sinfo", "-h", "-o", "%P %T"], capture_output=True, text=True)
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        name, state = line.split()
        if name.endswith("*") and state.startswith(("idle", "mix", "alloc")):
            return name.rstrip("*")
    return None


PARTITION = _cluster_partition()
slurm_cluster = pytest.mark.skipif(
    PARTITION is None and not os.environ.get("CI"),
    reason="no SLURM here: run scripts/slurm/local-cluster.sh start (CI does)",
)


def _summary(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / "sweep_summary.json").read_text())


def _array_id(sweep_dir: Path) -> str:
    """The SLURM array job of the sweep's jobs (submitit's folders are <array>_<task>)."""
    (array,) = {
        p.name.split("_")[0]
        for p in (sweep_dir / ".submitit").iterdir()
        if re.fullmatch(r"\d+_\d+", p.name)
    }
    return array


@slurm_cluster
def test_two_job_sweep_runs_on_slurm(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "hydra/launcher=submitit_slurm",
            *TINY,
            "trainer.seed=1,2",
            f"hydra.sweep.dir={sweep_dir}",
            # What a cluster usually wants said (README "Sweeps on SLURM").
            f"hydra.launcher.partition={PARTITION}",
            "hydra.launcher.timeout_min=10",
            "hydra.launcher.cpus_per_task=1",
        ],
        tmp_path,
        timeout=600,
    )
    check_ok(proc)
    rows = _summary(sweep_dir)["rows"]
    assert [(r["job"], r["status"]) for r in rows] == [(0, "done"), (1, "done")]
    array = _array_id(sweep_dir)
    for job, seed in ((0, 1), (1, 2)):
        job_dir = sweep_dir / str(job)
        assert json.loads((job_dir / "status.json").read_text())["status"] == "done"
        assert json.loads((job_dir / "summary.json").read_text())["steps"] == 1
        assert f"seed: {seed}" in (job_dir / "config.yaml").read_text()
        # Each ran as a task of one SLURM array job, started by submitit.
        log = (sweep_dir / ".submitit" / f"{array}_{job}" / f"{array}_{job}_0_log.out").read_text()
        assert f"job_id={array}_{job}" in log and "Job completed successfully" in log
    script = (sweep_dir / ".submitit" / array / f"{array}_submission.sh").read_text()
    assert f"--partition={PARTITION}" in script and "--time=10" in script
    assert "--cpus-per-task=1" in script and "--signal=USR2@" in script


@slurm_cluster
def test_preempted_jobs_are_requeued_and_resume_exactly(tmp_path):
    """Two of three identical jobs are interrupted mid-run: job 0 by SIGUSR2 alone (submitit's
    signal, what SLURM sends before the time limit), job 1 by SIGTERM and a second later SIGUSR2
    (a preemption as submitit's own tests send it). Each saves last.pt, submitit requeues it,
    and the requeued job resumes from last.pt and ends with the weights and metrics of job 2,
    which ran uninterrupted."""
    (tmp_path / "slowhook.py").write_text(SLOW_HOOK)
    sweep_dir = tmp_path / "sweep"
    argv = [
        "-m",
        "hydra/launcher=submitit_slurm",
        *TINY,
        "dataset.num_train=256",
        "loader.batch_size=32",
        "trainer.max_epochs=3",  # 3 x 8 steps
        "trainer.ckpt_every_n_steps=1",
        "trainer.log_every_n_steps=1",
        "+callbacks.slow._target_=slowhook.Slow",
        "+callbacks.slow.seconds=0.3,0.3,0",  # jobs 0 and 1 slow enough to catch mid-run
        f"hydra.sweep.dir={sweep_dir}",
        "trainer.plot_curves=false",
    ]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONUNBUFFERED="1", ACCEL_TRAIN_DATA_DIR=str(tmp_path / "no-data-here"))
    with open(tmp_path / "sweep.log", "w") as out:
        sweep = subprocess.Popen(
            [str(Path(sys.executable).parent / "accel-train"), *argv],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            for job in (0, 1):
                last = sweep_dir / str(job) / "checkpoints" / "last.pt"
                wait_for(last.exists, 600, f"job {job}'s first checkpoint")
            array = _array_id(sweep_dir)
            subprocess.run(["scancel", "--signal=USR2", f"{array}_0"], check=True)
            subprocess.run(["scancel", "--signal=TERM", f"{array}_1"], check=True)
            time.sleep(1)
            subprocess.run(["scancel", "--signal=USR2", f"{array}_1"], check=True)
            assert sweep.wait(timeout=900) == 0, (tmp_path / "sweep.log").read_text()[-4000:]
        finally:
            if sweep.poll() is None:
                sweep.kill()
    assert [r["status"] for r in _summary(sweep_dir)["rows"]] == ["done", "done", "done"]
    reference = json.loads((sweep_dir / "2" / "summary.json").read_text())
    for job, stop_event in ((0, "preempted"), (1, None)):
        job_id = f"{array}_{job}"
        log = (sweep_dir / ".submitit" / job_id / f"{job_id}_0_log.out").read_text()
        assert "this job is preempted" in log and f"Requeued job {job_id}" in log, log[-4000:]
        assert "resuming from" in log and slurm_job_field(job_id, "Restarts") == "1"
        events = [r.get("event") for r in read_jsonl(sweep_dir / str(job) / "metrics.jsonl")]
        assert events.count("resume") == 1
        # Job 1 stopped on its SIGTERM, unless its SIGUSR2 came before the next step.
        stops = [e for e in events if e in ("preempted", "stopped")]
        assert stops == [stop_event] if stop_event else len(stops) == 1, events
        summary = json.loads((sweep_dir / str(job) / "summary.json").read_text())
        for key in ("steps", "final_val_loss", "final_val_acc", "test_loss", "test_acc"):
            assert summary[key] == reference[key], (job, key)
        assert_same_weights(
            sweep_dir / str(job) / "checkpoints" / "last.pt",
            sweep_dir / "2" / "checkpoints" / "last.pt",
        )


# ---- errors a user can cause -------------------------------------------------------------


def test_no_slurm_here_is_a_user_error(tmp_path):
    env = {"PATH": str(Path(sys.executable).parent)}  # no sbatch/srun on this PATH
    proc = run_cli(
        ["-m", "hydra/launcher=submitit_slurm", *TINY, f"hydra.sweep.dir={tmp_path}/sweep"],
        tmp_path,
        env=env,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert "`sbatch`" in proc.stderr and "hydra/launcher=submitit_local" in proc.stderr
    assert "jobs ok" not in proc.stdout  # no empty sweep table after the error


@slurm_cluster
def test_refused_submission_names_the_keys(tmp_path):
    proc = run_cli(
        [
            "-m",
            "hydra/launcher=submitit_slurm",
            *TINY,
            "hydra.launcher.partition=nosuchpartition",
            f"hydra.sweep.dir={tmp_path}/sweep",
        ],
        tmp_path,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    error = proc.stderr.split("accel-train: error: ", 1)[1]
    assert "sbatch refused" in error and "partition" in error.lower()
    assert "hydra.launcher.KEY=VALUE" in error and "additional_parameters" in error
    assert not list((tmp_path / "sweep").rglob("status.json"))


# ---- the signal rules and the hand-over to submitit, in-process ----------------------------


def test_stop_request_in_a_submitit_job(monkeypatch):
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert StopRequest(rank=0).submitit_signal is None  # not a submitit job: USR2 untouched
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    stop = StopRequest(rank=0)
    with stop.installed():
        assert signal.getsignal(signal.SIGUSR2) == stop._handle
        stop._handle(signal.SIGTERM, None)
        assert stop.exits  # SIGTERM alone: checkpoint and exit 143, as outside submitit
        stop._handle(signal.SIGUSR2, None)
        assert not stop.exits and stop.signum == signal.SIGUSR2  # preemption: requeue
        stop._handle(signal.SIGTERM, None)  # the same preemption's SIGTERM, or the requeue's
        assert not stop.exits
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL  # submitit's comes back
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "HUP")
    assert StopRequest(rank=0).submitit_signal == signal.SIGHUP


def test_job_out_of_time_requeues_is_a_user_error(monkeypatch, tmp_path):
    """submitit's own handler, asked after the checkpoint, refuses: a job that reached its time
    limit with no requeue left (max_num_timeout used up). The error says which key to raise."""
    from submitit.core.job_environment import SignalHandler
    from submitit.core.utils import DelayedSubmission, JobPaths
    from submitit.slurm.slurm import SlurmJobEnvironment

    for key, value in {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "77",
        "SLURM_PROCID": "0",
        "SUBMITIT_FOLDER": str(tmp_path),
    }.items():
        monkeypatch.setenv(key, value)
    delayed = DelayedSubmission(print)
    delayed.set_timeout(1, 0)  # 1 minute (so any signal counts as the time limit), 0 requeues
    handler = SignalHandler(SlurmJobEnvironment(), JobPaths(tmp_path, "77"), delayed)
    previous = signal.signal(signal.SIGUSR2, handler.checkpoint_and_try_requeue)
    try:
        with pytest.raises(UserError, match=r"hydra\.launcher\.max_num_timeout") as raised:
            requeue_or_stop(3, tmp_path / "last.pt")
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert "resume=auto" in str(raised.value) and str(tmp_path / "last.pt") in str(raised.value)


def test_job_without_result_is_a_user_error(monkeypatch, capsys):
    """A job that SLURM ended without a result (cancelled, out of memory): the plugin raises
    submitit's UncompletedJobError while collecting results; the error says how to finish the
    sweep. (On the local cluster, which keeps no accounting, submitit cannot tell such a job
    from a running one, so this is checked without SLURM.)"""
    from omegaconf import OmegaConf
    from submitit.core.utils import UncompletedJobError

    from accel_train.launchers import submitit_launcher

    class Plugin:  # stands in for the plugin's launcher: the job was lost
        def launch(self, job_overrides, initial_job_idx):
            raise UncompletedJobError(
                "Job 41_1 (task: 0) with path /s/.submitit/41_1/41_1_0_result.pkl\n"
                "has not produced any output (state: CANCELLED by 0)\n"
                "Error stream produced:\n----------------------------------------\nsome log"
            )

    class Launcher(submitit_launcher.ReportErrors, Plugin):
        config = OmegaConf.create({"hydra": {"sweep": {"dir": "/s"}}})
        params: dict = {}

    monkeypatch.setattr(submitit_launcher.shutil, "which", lambda name: f"/usr/bin/{name}")
    with pytest.raises(SystemExit) as exited:
        Launcher().launch([["x=1"]], 0)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "Job 41_1" in error and "state: CANCELLED" in error and "some log" not in error
    assert "resume=auto hydra.sweep.dir=/s" in error and "Traceback" not in error
