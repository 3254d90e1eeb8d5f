"""SLURM: render and submit the batch script, find our place inside an allocation, requeue.

The parent (on the login node) writes <run_dir>/submit.sbatch and calls `sbatch`. In the job,
`srun` starts one `python -m accel_train.node` per node: a torchrun agent whose rendezvous is
on the allocation's first host. A requeued job runs the same script into the same run dir and
resumes from checkpoints/last.pt.

In a job of Hydra's submitit launcher (`hydra/launcher=submitit_slurm`, sweep jobs) submitit
owns the requeue: after the preemption checkpoint, `requeue_or_stop` calls submitit's own
handler of its preemption signal, which asks the launcher's `checkpoint()` for the same job
again, counts the time-limit requeues (hydra.launcher.max_num_timeout) and runs
`scontrol requeue`. The requeued job runs the same Hydra job, which resumes from last.pt
(`commands/sweep.py`).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from accel_train.environment import in_allocation, in_srun_step
from accel_train.errors import UserError
from accel_train.train.signals import submitit_preempt_signal, submitit_signal_received

log = logging.getLogger("accel_train")

# Several nodes need a rendezvous port they can all compute, stable across requeues. Both
# ranges stay below Linux's ephemeral ports (32768-60999): there any outgoing connection on
# the node (another job's gloo or NCCL sockets) may hold the port by chance. One node needs
# no agreed port at all: it binds port 0 and the OS picks a free one.
BASE_PORT = 29500  # submit.sbatch's rendezvous port: BASE_PORT + job id % 3000
STEP_BASE_PORT = 20000  # `srun accel-train` in a user's allocation: a range of its own


def step_port(job_id: str | int, step_id: str | int) -> int:
    """The rendezvous port of `srun accel-train` in a user's allocation (several nodes)."""
    return STEP_BASE_PORT + int(job_id) % 900 * 10 + int(step_id) % 10


def head_node() -> str:
    """The first host of the allocation (what `scontrol show hostnames` lists first)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    )
    return out.stdout.split()[0]


def adopt_srun_task(cfg: DictConfig) -> None:
    """`srun accel-train ...` inside an allocation: one task per node becomes a node agent
    (torchrun); one task per process becomes a worker directly (torchrun's variables from
    SLURM's, as torchrun would set them). The launcher (local, torchrun) calls it."""
    env = os.environ
    nodes, ntasks = int(env["SLURM_JOB_NUM_NODES"]), int(env["SLURM_NTASKS"])
    head = head_node()
    port = step_port(env["SLURM_JOB_ID"], env["SLURM_STEP_ID"])
    if ntasks == nodes:
        lc = cfg.launcher
        lc.nnodes, lc.node_rank = str(nodes), int(env["SLURM_NODEID"])
        lc.rdzv_endpoint = f"{head}:{port}" if nodes > 1 else "localhost:0"
        lc.rdzv_id = f"{env['SLURM_JOB_ID']}_{env['SLURM_STEP_ID']}"
        return
    env.update(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=str(ntasks),
        LOCAL_RANK=env["SLURM_LOCALID"],
        LOCAL_WORLD_SIZE=str(ntasks // nodes),
        MASTER_ADDR=head,
        MASTER_PORT=str(port),
    )


def processes_per_node(lc: DictConfig) -> int:
    return lc.gpus_per_node if lc.gpus_per_node > 0 else int(lc.nproc_per_node)


def render_sbatch(cfg: DictConfig, config_path: Path) -> str:
    """The batch script for this run. Lines meant for each node's own shell are escaped (\\$)."""
    lc, run_dir = cfg.launcher, Path(cfg.paths.output_dir)
    q = shlex.quote
    directives = [
        f"--job-name={lc.job_name or cfg.name}",
        f"--nodes={lc.nodes}",
        "--ntasks-per-node=1",  # one torchrun agent per node; it starts the per-GPU workers
        *([f"--gpus-per-node={lc.gpus_per_node}"] if lc.gpus_per_node else []),
        *([f"--cpus-per-task={lc.cpus_per_task}"] if lc.cpus_per_task else []),
        *([f"--mem={lc.mem}"] if lc.mem else []),
        f"--time={lc.time}",
        *([f"--partition={lc.partition}"] if lc.partition else []),
        *([f"--account={lc.account}"] if lc.account else []),
        *([f"--qos={lc.qos}"] if lc.qos else []),
        *([f"--constraint={lc.constraint}"] if lc.constraint else []),
        *(["--exclusive"] if lc.exclusive else []),
        f"--output={run_dir}/slurm-%j.out",
        "--open-mode=append",  # a requeued job appends to the same log
        "--requeue",
        # USR1 to every task (the node agents, which pass it to the workers) before the limit.
        f"--signal=USR1@{lc.signal_grace_s}",
        *[str(extra) for extra in lc.sbatch_extra],
    ]
    node_cmd = " ".join(
        [
            q(sys.executable),
            "-m accel_train.node",
            q(str(config_path)),
            "--nnodes \\$SLURM_JOB_NUM_NODES",
            "--node-rank \\$SLURM_NODEID",
            "--rdzv-endpoint $HEAD_NODE:$RDZV_PORT",
            "--rdzv-id \\$SLURM_JOB_ID",
        ]
    )
    lines = [
        "#!/bin/bash",
        f"# Written by accel-train for the run in {run_dir}.",
        f"# Resubmit (resumes from last.pt): sbatch {q(str(run_dir / 'submit.sbatch'))}",
        *[f"#SBATCH {d}" for d in directives],
        "",
        "set -eo pipefail",
        *[str(line) for line in lc.setup],
        # sed reads every line: `head -n 1` exits early and, under pipefail, scontrol's
        # SIGPIPE (exit 141) would fail the job.
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        # One node: port 0, a free port the OS picks (see BASE_PORT).
        f"RDZV_PORT=$(( SLURM_JOB_NUM_NODES > 1 ? {BASE_PORT} + SLURM_JOB_ID % 3000 : 0 ))",
        'echo "accel-train: job $SLURM_JOB_ID (requeue ${SLURM_RESTART_COUNT:-0}) on '
        '$SLURM_JOB_NODELIST, rendezvous $HEAD_NODE:$RDZV_PORT"',
        # bash -c so that each node's own shell expands the escaped variables.
        f'srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "exec {node_cmd}"',
        "",
    ]
    return "\n".join(lines)


def submit(cfg: DictConfig, config_path: Path) -> str | None:
    """Write submit.sbatch into the run dir and submit it; returns the job id (None: dry run)."""
    run_dir = Path(cfg.paths.output_dir)
    script = run_dir / "submit.sbatch"
    script.write_text(render_sbatch(cfg, config_path))
    script.chmod(0o755)
    if in_allocation() and not in_srun_step():
        # Already inside an allocation (salloc, or the user's own batch script): run the script
        # body here, its srun uses this allocation. Submitting again would double-launch.
        log.info(
            "inside SLURM job %s: running %s in this allocation", os.environ["SLURM_JOB_ID"], script
        )
        result = subprocess.run(["bash", str(script)], check=False)
        if result.returncode != 0:
            raise UserError(f"the job step failed (exit {result.returncode}); see {run_dir}/logs.")
        return os.environ["SLURM_JOB_ID"]
    if not cfg.launcher.submit:
        print(script.read_text())
        log.info("launcher.submit=false: wrote %s, submitted nothing", script)
        return None
    if shutil.which("sbatch") is None:
        raise UserError(
            "launcher=slurm: `sbatch` is not on PATH (this is not a SLURM login node?). "
            "`launcher.submit=false` writes and prints the batch script without submitting; "
            "scripts/slurm/local-cluster.sh start runs a one-node SLURM on this machine."
        )
    result = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        message = " ".join((result.stderr or result.stdout).split())
        raise UserError(
            f"sbatch rejected the job: {message}. Check the launcher.* options (partition, time, "
            f"gpus_per_node, mem, sbatch_extra) or edit and submit {script} yourself."
        )
    job_id = result.stdout.strip().split(";")[0]
    log.info(
        "submitted SLURM job %s\n  script: %s\n  log:    %s\n  ranks:  %s",
        job_id,
        script,
        run_dir / f"slurm-{job_id}.out",
        run_dir / "logs",
    )
    return job_id


# Requeues allowed when the run was not submitted with launcher=slurm (whose max_requeues sets
# it), e.g. `srun accel-train ...` in the user's own batch script.
DEFAULT_MAX_REQUEUES = 3


def requeue_or_stop(max_requeues: int, checkpoint: Path) -> None:
    """After a preemption checkpoint (rank 0): requeue this job, or explain why not."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        log.warning("stopped on request; the run resumes with `resume=auto` from %s", checkpoint)
        return
    if _requeue_through_submitit(job_id, checkpoint):
        return
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if restarts >= max_requeues:
        raise UserError(
            f"SLURM job {job_id} was preempted or hit its time limit after {restarts} requeues "
            f"(launcher.max_requeues={max_requeues}); not requeueing again. The latest "
            f"checkpoint is {checkpoint}: resubmit the run's submit.sbatch to continue."
        )
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(
            f"`scontrol requeue {job_id}` failed: {' '.join(result.stderr.split())}. The "
            f"checkpoint {checkpoint} is safe: resubmit the run's submit.sbatch to continue."
        )
    log.info("requeued SLURM job %s (requeue %d of %d)", job_id, restarts + 1, max_requeues)


# ---- jobs of Hydra's submitit launcher ---------------------------------------------------


class Requeued(SystemExit):
    """submitit requeued this job after the checkpoint: the process ends here, without a result
    (submitit writes none for a requeued job, so the sweep waits for the requeued run)."""


def requeued_submitit_job() -> bool:
    """A submitit SLURM job that SLURM has started again (requeued after a preemption or the
    time limit): it must continue from its last.pt, not start over."""
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    return submitit_preempt_signal() is not None and restarts > 0


# How long a submitit job stopped by SIGTERM waits for submitit's preemption signal before it
# exits. SLURM sends SIGTERM to cancel a job and also, with that signal, to preempt one (a few
# hundred ms apart), which is why submitit ignores SIGTERM; it SIGKILLs a cancelled job after
# KillWait (30 s by default) anyway.
PREEMPTION_SIGNAL_WAIT_S = 30.0


def await_submitit_requeue(checkpoint: Path) -> None:
    """In a submitit job that saved `checkpoint` on SIGTERM and is about to exit (143): if
    submitit's preemption signal came (or comes within PREEMPTION_SIGNAL_WAIT_S), the job is
    requeued (raises Requeued), as submitit would have; else return and let it exit."""
    signum, job_id = submitit_preempt_signal(), os.environ.get("SLURM_JOB_ID")
    if signum is None or job_id is None or _submitit_handler(signum) is None:
        return
    if submitit_signal_received():  # it came while the loop was saving: hand it over now
        _requeue_through_submitit(job_id, checkpoint)
        return
    log.warning(
        "SIGTERM: checkpoint saved; waiting up to %.0f s for submitit's %s (a preemption: "
        "the job is then requeued) before exiting",
        PREEMPTION_SIGNAL_WAIT_S,
        signum.name,
    )
    deadline = time.monotonic() + PREEMPTION_SIGNAL_WAIT_S
    try:
        while time.monotonic() < deadline:
            time.sleep(0.2)  # submitit's own handler is back: it requeues and exits
    except SystemExit as requeued:
        raise Requeued(requeued.code) from None


def _submitit_handler(signum: int):
    """submitit's handler of its preemption signal, if that is what this process has: the
    process submitit started (not, e.g., a torchrun worker of a submitit job)."""
    handler = signal.getsignal(signum)
    owner = getattr(handler, "__self__", None)
    return handler if type(owner).__module__.startswith("submitit.") else None


def _requeue_through_submitit(job_id: str, checkpoint: Path) -> bool:
    """In a submitit job: let submitit requeue it, as if its signal came now that last.pt is
    saved. Raises Requeued, or a UserError saying why submitit did not requeue; False when
    this is no submitit job (the caller requeues)."""
    signum = submitit_preempt_signal()
    handler = _submitit_handler(signum) if signum is not None else None
    if handler is None:
        return False
    if os.environ.get("SLURM_ARRAY_TASK_ID"):  # a sweep's jobs are one array: say 31_0, not 32
        job_id = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    log.info("checkpoint %s saved; submitit requeues SLURM job %s", checkpoint, job_id)
    try:
        handler(signum, None)  # checkpoint(), then `scontrol requeue` and sys.exit(-1)
    except SystemExit as requeued:
        raise Requeued(requeued.code) from None
    except Exception as err:  # submitit's UncompletedJobError, or scontrol failing
        reason = " ".join(str(err).split()).rstrip(".")
        hint = (
            "hydra.launcher.max_num_timeout (how often a job that reaches its time limit is "
            "requeued) is used up: raise it, or hydra.launcher.timeout_min"
            if "timed-out" in reason
            else "see the job's log in the sweep dir's .submitit/"
        )
        raise UserError(
            f"SLURM job {job_id} was preempted or reached its time limit and submitit did not "
            f"requeue it ({reason}); {hint}. The checkpoint {checkpoint} is kept: run the same "
            "sweep again with `resume=auto` and the same `hydra.sweep.dir` to continue."
        ) from None
    raise UserError(
        f"SLURM job {job_id}: submitit's handler of {signal.Signals(signum).name} neither "
        f"requeued the job nor said why (not task 0?). The checkpoint {checkpoint} is kept: run "
        "the same sweep again with `resume=auto` and the same `hydra.sweep.dir` to continue."
    )
