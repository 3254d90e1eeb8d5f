"""Start the worker group through torchrun's own Python API (torch.distributed.run)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from accel_train.environment import LAUNCHER_PID
from accel_train.errors import UserError
from accel_train.launchers.rendezvous import Arrivals, check_rendezvous, timed_out

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

log = logging.getLogger("accel_train")

WORKER_MODULE = "accel_train.worker"


def torchrun_argv(cfg: DictConfig, config_path: Path, nproc: int) -> list[str]:
    """torchrun's command line for this run (also what `--submit=false` style dry runs show)."""
    lc = cfg.launcher
    run_dir = Path(cfg.paths.output_dir)
    rdzv_id = lc.rdzv_id or uuid.uuid4().hex[:12]  # several nodes: check_rendezvous demands one
    log_dir = Path(lc.log_dir) if lc.log_dir else run_dir / "logs"
    return [
        f"--nnodes={lc.nnodes}",
        f"--nproc_per_node={nproc}",
        # c10d assigns node ranks itself; torchrun only reads --node_rank for `static`.
        *([f"--node_rank={lc.node_rank}"] if lc.rdzv_backend == "static" else []),
        f"--rdzv_backend={lc.rdzv_backend}",
        f"--rdzv_endpoint={lc.rdzv_endpoint}",
        f"--rdzv_id={rdzv_id}",
        f"--rdzv_conf=join_timeout={lc.rdzv_timeout}{_is_host(lc)}",
        f"--max_restarts={lc.max_restarts}",
        f"--monitor_interval={lc.monitor_interval}",
        f"--log_dir={log_dir / f'node{lc.node_rank}'}",
        "--redirects=3",  # every rank's stdout/stderr into its own file under log_dir ...
        "--tee=3",  # ... and onto the console too,
        "--local_ranks_filter=0",  # but only local rank 0's.
        "--module",
        WORKER_MODULE,
        str(config_path),
    ]


def _is_host(lc: DictConfig) -> str:
    """Several nodes under c10d: node 0 hosts the store, the others never do. (torch would
    otherwise guess from the endpoint's name, and a name or address of this machine that it
    does not recognise left node 0 waiting for a store nobody started.)"""
    if str(lc.nnodes) == "1" or lc.rdzv_backend != "c10d":
        return ""
    return f",is_host={'true' if int(lc.node_rank) == 0 else 'false'}"


def run_torchrun(cfg: DictConfig, config_path: Path, nproc: int) -> None:
    check_rendezvous(cfg)
    if cfg.launcher.omp_num_threads:
        os.environ["OMP_NUM_THREADS"] = str(cfg.launcher.omp_num_threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        # torchrun's own default (1 thread per process when there are several), set quietly.
        cores = os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    # torchrun's own modules (~50 ms) only when it is used: launcher=local imports this file
    # and trains in-process.
    from torch.distributed.run import get_args_parser

    argv = torchrun_argv(cfg, config_path, nproc)
    log.info("torchrun %s", " ".join(argv))
    args = get_args_parser().parse_args(argv)
    # torchrun starts each worker in a session of its own, and they stay there: in the
    # launcher's process group a Ctrl-C in the terminal would reach every worker directly and
    # again through the agent, which forwards it, and a second SIGINT exits without saving
    # (train/signals.py). So a kill of this process group reaches only this process; the
    # workers end with it through the parent-death signal they arm at start
    # (environment.die_with_launcher), which reads this pid.
    os.environ[LAUNCHER_PID] = str(os.getpid())  # (for the workers only: removed after the run)
    # SIGUSR1 (SLURM's warning before the time limit, `scancel --signal=USR1`, or a user's
    # `kill -USR1`) reaches this agent; the workers checkpoint at their next step on it.
    signal.signal(signal.SIGUSR1, _forward_to_workers)
    multi_node = str(cfg.launcher.nnodes).isdigit() and int(cfg.launcher.nnodes) > 1
    arrivals = Arrivals(cfg).start() if multi_node else None
    try:
        _run_agent(cfg, args, arrivals)
    finally:
        os.environ.pop(LAUNCHER_PID, None)
        if arrivals is not None:
            arrivals.stop.set()


def _run_agent(cfg: DictConfig, args, arrivals: Arrivals | None) -> None:
    """torchrun's agent in this process, to the end of the run; a signal that stopped it, a
    rendezvous that timed out or a failed worker said the launcher's way."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import run

    try:
        run(args)
    except RendezvousTimeoutError:
        raise timed_out(cfg, arrivals) from None
    except SignalException as err:
        # SIGTERM/SIGINT (docker stop, Ctrl-C, SLURM cancelling or requeueing the job): the
        # agent forwarded it to the workers and waited for them (--shutdown_timeout, 30 s), and
        # they saved last.pt at their next logging step (train/signals.py).
        run_dir = Path(cfg.paths.output_dir)
        log.warning(
            "torchrun agent stopped by %s; continue with `resume=auto hydra.run.dir=%s`",
            err.sigval.name,
            run_dir,
        )
        sys.exit(128 + err.sigval.value)
    except ChildFailedError as err:
        rank, failure = _root_failure(err)
        detail = _worker_error(failure)
        run_dir = Path(cfg.paths.output_dir)
        saved = any((run_dir / "checkpoints").glob("last.*"))
        hint = (
            f"; its checkpoints are kept: rerun with `resume=auto hydra.run.dir={run_dir}` "
            "to continue"
            if saved
            else ""
        )
        raise UserError(
            f"worker rank {rank} failed (exit code {failure.exitcode}){detail}. The workers' "
            f"logs are under {Path(args.log_dir)}{hint}."
        ) from None


def _child_pids(parent: int) -> list[int]:
    """PIDs whose parent is `parent`: torchrun starts workers in sessions of their own, so a
    process-group signal would not reach them."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            pids.append(int(entry.name))
    return pids


def _forward_to_workers(signum, frame) -> None:
    for pid in _child_pids(os.getpid()):
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.kill(pid, signum)


def _root_failure(err: ChildFailedError):
    """The failed worker to report: one killed by a signal the agent does not send itself (a
    SIGKILL: the OOM killer, `kill -9`) caused its peers' errors (a connection reset when it
    vanished), which their error files date earlier than the agent saw it die; otherwise
    torchrun's first failure by time (a worker's exception, its peers stopped by SIGTERM)."""
    killed = [
        (rank, f)
        for rank, f in sorted(err.failures.items())
        if f.exitcode < 0 and -f.exitcode != signal.SIGTERM
    ]
    return killed[0] if killed else err.get_first_failure()


def _worker_error(failure) -> str:
    """What the failed worker said (torchrun's ProcessFailure, from the error file the worker
    wrote: launchers/worker.py): a UserError's paragraph as it is; another exception's
    `Type: message` on one line, with the log that holds its traceback."""
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = failure.message if isinstance(failure.message, str) else ""
    text = message.strip()
    if not text or "user_error" not in data:  # no error file of ours: a signal, torch's own
        lines = text.splitlines()
        return f": {lines[-1].rstrip('.')}" if lines else ""
    if data["user_error"]:
        return f": {text.rstrip('.')}"
    line = " ".join(text.split())
    line = line if len(line) <= 500 else line[:500] + "..."
    log_file = Path(failure.error_file).parent / "stderr.log" if failure.error_file else None
    where = f" (its traceback: {log_file})" if log_file and log_file.is_file() else ""
    return f": {line.rstrip('.')}{where}"
