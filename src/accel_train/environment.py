"""Where this process runs (a torchrun worker? a SLURM job or srun step?), read from environment
variables only, the config resolvers that depend on it, a worker's tie to the process that
launched it, and how a finished command's process ends. Imports no torch: the CLI loads this
before Hydra composes, so a typo in an override fails in well under a second."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time
from datetime import datetime

from omegaconf import OmegaConf

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# The pid of the process that runs torchrun's agent for this node (accel-train, or a SLURM
# node's `python -m accel_train.node`), set there for its workers (die_with_launcher).
LAUNCHER_PID = "ACCEL_TRAIN_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def inside_torchrun() -> bool:
    """True in a process started by torchrun (or anything that sets its variables)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def in_allocation() -> bool:
    return "SLURM_JOB_ID" in os.environ


def in_srun_step() -> bool:
    """A task started by srun (the batch script itself has no SLURM_STEP_ID)."""
    return in_allocation() and "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ


def run_stamp(rdzv_id: str | None, nnodes: str) -> str:
    """The last part of the run dir: a timestamp, or an id that every node and rank shares."""
    if str(nnodes) != "1" and rdzv_id:
        return str(rdzv_id)
    if inside_torchrun() and os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun_{os.environ['TORCHELASTIC_RUN_ID']}"
    if in_srun_step():  # `srun accel-train ...`: every task must find the same dir
        return f"slurm_{os.environ['SLURM_JOB_ID']}_{os.environ['SLURM_STEP_ID']}"
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")


def node_suffix(node_rank: int, nnodes: str) -> str:
    """Nodes share a run dir: node 0 writes train.log and .hydra/, node k train.node<k>.log..."""
    return "" if str(nnodes) == "1" or int(node_rank) == 0 else f".node{node_rank}"


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("node_suffix", node_suffix, replace=True)


def die_with_launcher() -> None:
    """End this torchrun worker when the process that launched it ends, however that ended
    (SIGKILL included): within a second, not at the end of training. torchrun starts its
    workers in sessions of their own (launchers/torchrun_process.py says why they stay there),
    so a signal to the launcher's process group never reaches them; left alone they would train
    to the end, write summary.json and hold the run dir's lock against the next resume.

    On Linux the kernel sends SIGKILL when the parent exits (prctl PR_SET_PDEATHSIG; the
    parent is torchrun's agent, which runs in the launching process's main thread); elsewhere a
    thread polls the parent's pid. The launcher's pid comes from $ACCEL_TRAIN_LAUNCHER_PID, so
    a launcher that died before this ran (the worker reparented already) is noticed too; under
    a user's own torchrun, the parent this process started with. SIGKILL, like the launcher's
    own end: what a SIGKILL may lose is bounded by trainer.ckpt_every_n_steps (reliability)."""
    launcher = _launcher_pid()
    if not _parent_death_signal(signal.SIGKILL):
        threading.Thread(target=_watch_parent, args=(launcher,), daemon=True).start()
    if os.getppid() != launcher:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def _launcher_pid() -> int:
    """$ACCEL_TRAIN_LAUNCHER_PID when it names the parent, or a process gone (the launcher,
    dead before this ran); the parent otherwise (a live process of that pid that is not the
    parent set it for other workers: this one runs under a torchrun of its own)."""
    parent, named = os.getppid(), os.environ.get(LAUNCHER_PID, "")
    if not named.isdigit() or int(named) == parent:
        return parent
    try:
        os.kill(int(named), 0)
    except ProcessLookupError:
        return int(named)
    except PermissionError:  # alive, someone else's
        pass
    return parent


def _parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def exit_without_teardown(code: int = 0) -> None:
    """End a finished command's process (accel-train, its torchrun workers, accel-eval,
    -export, -sample, -data) without the interpreter's teardown, which frees torch's, sympy's
    and Hydra's modules object by object: 1-2 s of CPU after a run (BENCHMARKS.md section 9),
    more than a short run's steps, and, in a worker, a teardown of gloo's or NCCL's objects in
    no safe order. What must happen at exit happens first, in the order a normal exit has it:
    the threading module's exit hooks (they tell concurrent.futures' pools, e.g. Inductor's
    compile workers, to stop; joined before them, an idle pool's workers would wait forever),
    every thread that is not a daemon joined (an async checkpoint save), the atexit handlers
    (logging's flush of train.log, trackers' finish, weakref finalizers, DataLoader workers'
    clean-up), stdout and stderr flushed. Errors and interrupts end the usual way."""
    threading._shutdown()  # noqa: SLF001
    atexit._run_exitfuncs()  # noqa: SLF001 - the handlers a normal exit runs, in its order
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
