"""SLURM: the rendered batch script (unit), and real jobs on the localhost cluster that
scripts/slurm/local-cluster.sh starts (CI starts it before pytest)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAST, check_ok, read_jsonl, run_cli, slurm_job_field, wait_for
from omegaconf import OmegaConf

from accel_train.config.run_config import load_run_config, typed
from accel_train.launchers import slurm_job
from accel_train.launchers.slurm_job import render_sbatch

# One test process for all of them: they share the local cluster's queue (pytest-xdist).
# About SLURM: its CLI runs start a new interpreter, never the warm parent
# (tests/warm_cli.py).
pytestmark = [pytest.mark.xdist_group("slurm"), pytest.mark.fresh]


def _cfg(tmp_path: Path, **launcher) -> OmegaConf:
    return typed(
        {
            "name": "mnist_amp",
            "paths": {"output_dir": str(tmp_path / "run dir")},  # a space: quoting must hold
            "launcher": {"name": "slurm", **launcher},
        }
    )


def _directives(script: str) -> dict[str, str]:
    pairs = [
        line.removeprefix("#SBATCH --").partition("=")
        for line in script.splitlines()
        if line.startswith("#SBATCH")
    ]
    return {key: value for key, _, value in pairs}


def test_one_node_script(tmp_path):
    cfg = _cfg(tmp_path, nproc_per_node="2", time="00:30:00", signal_grace_s=90)
    script = render_sbatch(cfg, tmp_path / "run dir" / "config.yaml")
    d = _directives(script)
    assert d["nodes"] == "1" and d["ntasks-per-node"] == "1"
    assert d["time"] == "00:30:00" and d["signal"] == "USR1@90"
    assert "requeue" in d and d["open-mode"] == "append"
    assert "gpus-per-node" not in d and "partition" not in d
    assert d["output"] == f"{tmp_path}/run dir/slurm-%j.out"
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_four_node_script(tmp_path):
    cfg = _cfg(
        tmp_path,
        nodes=4,
        gpus_per_node=8,
        partition="gpu",
        account="proj",
        qos="high",
        constraint="a100",
        mem="64G",
        cpus_per_task=32,
        exclusive=True,
        job_name="big",
        sbatch_extra=["--mail-type=END"],
        setup=["module load cuda/12.4"],
    )
    script = render_sbatch(cfg, tmp_path / "run dir" / "config.yaml")
    d = _directives(script)
    assert d["nodes"] == "4" and d["gpus-per-node"] == "8" and d["partition"] == "gpu"
    assert d["account"] == "proj" and d["qos"] == "high" and d["constraint"] == "a100"
    assert d["mem"] == "64G" and d["cpus-per-task"] == "32" and d["job-name"] == "big"
    assert "exclusive" in d and d["mail-type"] == "END"
    body = script.split("set -eo pipefail", 1)[1]
    assert body.index("module load cuda/12.4") < body.index("srun")
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    srun = next(line for line in script.splitlines() if line.startswith("srun"))
    # Each node's own shell expands these; the batch shell expands only the rendezvous host.
    for var in ("SLURM_NODEID", "SLURM_JOB_NUM_NODES", "SLURM_JOB_ID"):
        assert f"\\${var}" in srun
    assert "$HEAD_NODE:$RDZV_PORT" in srun and "\\$HEAD_NODE" not in srun
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_script_expands_per_node(tmp_path, monkeypatch):
    """Run the script with stand-ins for srun/scontrol: srun runs the task once per node the way
    SLURM would (its own SLURM_NODEID), and the Python interpreter is `echo`."""
    monkeypatch.setattr(sys, "executable", "echo")
    script = render_sbatch(_cfg(tmp_path, nodes=4), tmp_path / "run dir" / "config.yaml")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/bash\nprintf 'gpu-a\\ngpu-b\\ngpu-c\\ngpu-d\\n'\n")
    (fake / "srun").write_text(
        '#!/bin/bash\nfor n in 0 1 2 3; do SLURM_NODEID=$n "${@: -3}"; done\n'
    )
    for f in fake.iterdir():
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "1234",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_JOB_NODELIST": "gpu-[a-d]",
    }
    out = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    lines = [line for line in out.splitlines() if "accel_train.node" in line]
    assert len(lines) == 4
    for rank, line in enumerate(lines):
        assert f"--node-rank {rank} " in line
        assert "--nnodes 4 " in line and "--rdzv-endpoint gpu-a:30734" in line
        assert f"{tmp_path}/run dir/config.yaml" in line


def test_submit_false_writes_and_prints(tmp_path):
    proc = run_cli(
        [
            *FAST,
            "launcher=slurm",
            "launcher.submit=false",
            "launcher.nodes=2",
            "launcher.gpus_per_node=8",
            "strategy=ddp",
            f"hydra.run.dir={tmp_path}/run",
        ],
        tmp_path,
    )
    check_ok(proc)
    script = (tmp_path / "run" / "submit.sbatch").read_text()
    assert "#SBATCH --nodes=2" in proc.stdout and script.splitlines()[0] == "#!/bin/bash"
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").resume == "auto"


def test_an_escaped_dollar_reaches_the_script_literally(tmp_path):
    """`\\${HOME}` escaped for the shell of the job stays `${HOME}` in submit.sbatch, and in
    config.yaml, which the nodes load again (issue 22)."""
    proc = run_cli(
        [
            *FAST,
            "launcher=slurm",
            "launcher.submit=false",
            'launcher.setup=["source \\${HOME}/venv/bin/activate"]',
            f"hydra.run.dir={tmp_path}/run",
        ],
        tmp_path,
    )
    check_ok(proc)
    script = (tmp_path / "run" / "submit.sbatch").read_text()
    assert "\nsource ${HOME}/venv/bin/activate\n" in script
    loaded = load_run_config(tmp_path / "run" / "config.yaml")
    assert list(loaded.launcher.setup) == ["source ${HOME}/venv/bin/activate"]  # as read


def test_no_sbatch_is_a_clear_error(tmp_path):
    env = {"PATH": str(Path(sys.executable).parent)}  # no sbatch on this PATH
    proc = run_cli([*FAST, "launcher=slurm", f"hydra.run.dir={tmp_path}/run"], tmp_path, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout
    assert "sbatch" in proc.stderr and "launcher.submit=false" in proc.stderr


# ---- a real SLURM on localhost ---------------------------------------------------------------


def _cluster_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    return out.returncode == 0 and any(
        s.startswith(("idle", "mix", "alloc")) for s in out.stdout.split()
    )


slurm_cluster = pytest.mark.skipif(
    not _cluster_up() and not os.environ.get("CI"),
    reason="no SLURM here: run scripts/slurm/local-cluster.sh start (CI does)",
)


def _submit(tmp_path: Path, *overrides: str) -> tuple[str, Path]:
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            *FAST,
            "launcher=slurm",
            "strategy=ddp",
            "launcher.nproc_per_node=2",
            "launcher.time=00:10:00",
            f"hydra.run.dir={run_dir}",
            *overrides,
        ],
        tmp_path,
    )
    check_ok(proc)
    job_id = re.search(r"submitted SLURM job (\d+)", proc.stdout + proc.stderr).group(1)
    return job_id, run_dir


def _slurm_log(run_dir: Path) -> str:
    return "\n".join(p.read_text() for p in run_dir.glob("slurm-*.out"))


def _wait_until_started(job_id: str, log_dir: Path) -> None:
    """A job may wait in the queue behind another test's (test_submitit_slurm.py's jobs run on
    another test process): the time it pends is not the job's, so it gets its own long wait."""
    wait_for(
        lambda: slurm_job_field(job_id, "JobState") not in ("PENDING", ""),
        900,
        lambda: f"job {job_id} to start\n{_job_state(job_id, log_dir)}",
    )


def _job_state(job_id: str, log_dir: Path) -> str:
    """What a timed-out wait shows: the job's state and reason, the queue, and its log."""
    state = (
        f"JobState={slurm_job_field(job_id, 'JobState')} Reason={slurm_job_field(job_id, 'Reason')}"
    )
    queue = subprocess.run(["squeue"], capture_output=True, text=True).stdout
    return f"{state}\n{queue}\n{_slurm_log(log_dir)[-4000:]}"


@slurm_cluster
def test_job_runs_on_slurm_and_a_preempted_job_requeues_and_resumes(tmp_path):
    """`launcher=slurm` submits a 2-process DDP job that runs to the end, preempted once on
    the way (USR1, as SLURM signals before a preemption or the time limit): it saves, requeues
    itself into the same run dir and resumes from last.pt."""
    # 10 epochs x 4 steps; a checkpoint every step so the signal always finds one.
    job_id, run_dir = _submit(
        tmp_path,
        "trainer.max_epochs=10",
        "trainer.ckpt_every_n_steps=1",
        "trainer.log_every_n_steps=1",
        "dataset.num_train=512",
    )
    last = run_dir / "checkpoints" / "last.pt"
    _wait_until_started(job_id, run_dir)
    wait_for(
        last.exists, 240, lambda: f"a checkpoint of job {job_id}\n{_job_state(job_id, run_dir)}"
    )
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    summary = run_dir / "summary.json"
    wait_for(
        summary.exists,
        600,  # (a requeued job may wait in the queue again)
        lambda: f"the requeued job {job_id} to finish\n{_job_state(job_id, run_dir)}",
    )
    assert int(slurm_job_field(job_id, "Restarts") or 0) >= 1
    result = json.loads(summary.read_text())
    assert result["world_size"] == 2 and result["steps"] == 10 * 4  # 512 / (64 x 2) per epoch
    events = [r.get("event") for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert "preempted" in events and "resume" in events
    assert "requeue 1" in _slurm_log(run_dir)
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    assert (run_dir / "submit.sbatch").is_file() and f"job {job_id}" in _slurm_log(run_dir)


def _own_batch_job(tmp_path: Path, sbatch_lines: list[str], command: str) -> Path:
    """Submit a user's own batch script that calls accel-train; returns the job's output file."""
    out = tmp_path / "job.out"
    script = tmp_path / "job.sbatch"
    script.write_text(
        "\n".join(
            [
                "#!/bin/bash",
                *[f"#SBATCH {x}" for x in sbatch_lines],
                f"#SBATCH --output={out}",
                command,
                "",
            ]
        )
    )
    job_id = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True
    ).stdout.strip()

    def finished() -> bool:
        return not subprocess.run(
            ["squeue", "-h", "-j", job_id], capture_output=True, text=True
        ).stdout.strip()

    _wait_until_started(job_id, tmp_path)
    wait_for(finished, 240, f"job {job_id}")
    return out


@slurm_cluster
def test_srun_inside_own_batch_script(tmp_path):
    """`srun accel-train ...` with one task per process: the tasks become the workers of one
    job (no second launch), sharing one run dir named after the job step."""
    accel = Path(sys.executable).parent / "accel-train"
    out = _own_batch_job(
        tmp_path,
        ["--nodes=1", "--ntasks=2"],
        f"srun {accel} {' '.join(FAST)} strategy=ddp trainer.max_epochs=1 "
        f"paths.log_dir={tmp_path}/outputs",
    )
    runs = list((tmp_path / "outputs" / "train").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("slurm_"), out.read_text()
    assert json.loads((runs[0] / "summary.json").read_text())["world_size"] == 2


@slurm_cluster
def test_launcher_slurm_inside_allocation_does_not_resubmit(tmp_path):
    accel = Path(sys.executable).parent / "accel-train"
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    out = _own_batch_job(
        tmp_path,
        ["--nodes=1"],
        f"{accel} {' '.join(FAST)} launcher=slurm strategy=ddp launcher.nproc_per_node=2 "
        f"trainer.max_epochs=1 hydra.run.dir={tmp_path}/run",
    )
    log = out.read_text()
    assert "submitted SLURM job" not in log and "in this allocation" in log, log
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2
    assert before is not None


@slurm_cluster
def test_shipped_single_node_script_survives_preemption(tmp_path):
    """scripts/slurm/single_node.sbatch as shipped: 2 CPU processes, preempted once, requeued
    into the same run dir (named after the job), finishes with the full step count."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "slurm" / "single_node.sbatch"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    job_id = subprocess.run(
        [
            "sbatch",
            "--parsable",
            str(script),
            *FAST,
            "launcher.nproc_per_node=2",
            "trainer.max_epochs=10",
            "dataset.num_train=512",
            "trainer.ckpt_every_n_steps=1",
            "trainer.log_every_n_steps=1",
            f"paths.log_dir={tmp_path}/outputs",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    run_dir = tmp_path / "outputs" / "train" / f"slurm_{job_id}_0"
    last = run_dir / "checkpoints" / "last.pt"
    _wait_until_started(job_id, tmp_path)
    wait_for(
        last.exists, 240, lambda: f"a checkpoint of job {job_id}\n{_job_state(job_id, tmp_path)}"
    )
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    summary = run_dir / "summary.json"
    wait_for(
        summary.exists,
        600,  # (a requeued job may wait in the queue again)
        lambda: f"the requeued job {job_id} to finish\n{_job_state(job_id, tmp_path)}",
    )
    assert json.loads(summary.read_text())["steps"] == 10 * 4
    assert int(slurm_job_field(job_id, "Restarts") or 0) >= 1
    assert [r.get("event") for r in read_jsonl(run_dir / "metrics.jsonl")].count("resume") >= 1


@pytest.mark.parametrize(("nodes", "endpoint"), [("1", "localhost:0"), ("2", "n0:20130")])
def test_an_srun_step_never_picks_an_ephemeral_port(monkeypatch, nodes, endpoint):
    """One node binds a port the OS picks; several share a fixed one below Linux's ephemeral
    range (32768-60999), where another job's outgoing sockets could hold it (CI saw that)."""
    monkeypatch.setattr(slurm_job, "head_node", lambda: "n0")
    env = {"SLURM_JOB_NUM_NODES": nodes, "SLURM_NTASKS": nodes, "SLURM_NODEID": "0"}
    for key, value in {**env, "SLURM_JOB_ID": "13", "SLURM_STEP_ID": "0"}.items():
        monkeypatch.setenv(key, value)
    cfg = OmegaConf.create({"launcher": {"nnodes": "1", "node_rank": 0, "rdzv_endpoint": ""}})
    slurm_job.adopt_srun_task(cfg)
    assert cfg.launcher.rdzv_endpoint == endpoint and cfg.launcher.nnodes == nodes
    assert max(slurm_job.step_port(j, 9) for j in range(100_000)) < 32768


def test_requeue_stops_after_max_requeues(monkeypatch, tmp_path):
    from accel_train.errors import UserError
    from accel_train.launchers.slurm_job import requeue_or_stop

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    with pytest.raises(UserError, match=r"after 3 requeues \(launcher.max_requeues=3\)"):
        requeue_or_stop(3, tmp_path / "last.pt")


@slurm_cluster
@pytest.mark.parametrize(
    ("override", "slurm_says"),
    [("launcher.partition=nosuchpartition", "partition"), ("launcher.time=soon", "time")],
)
def test_rejected_submission_shows_slurms_message(tmp_path, override, slurm_says):
    proc = run_cli([*FAST, "launcher=slurm", override, f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr
    assert "sbatch rejected the job" in proc.stderr and slurm_says in proc.stderr.lower()
    assert (tmp_path / "run" / "submit.sbatch").is_file()  # kept, to edit and submit by hand
