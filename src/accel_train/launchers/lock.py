"""One writer per run dir: an `flock` on `<run_dir>/.lock`, which dies with its process.

Two runs in one run dir would overwrite each other's checkpoints and metrics, so a second
`accel-train` on a dir that a live run holds is refused, naming the holder (pid, host, start
time, written into the file). The lock is the kernel's, not the file's: a run that ended or was
killed (SIGKILL, OOM, a requeued SLURM job's dead predecessor) holds nothing, and the leftover
file blocks no one.

Who takes it (`role`), so that exactly one process of a run holds it before anything is
written into the dir:

- in-process and single-node torchrun runs: the launching `accel-train` process, before it
  writes config.yaml. Its torchrun workers join it (a shared lock on the same file, found
  through $ACCEL_TRAIN_RUN_LOCK), so workers that outlive a killed launcher (torchrun starts
  them in sessions of their own; they end within a second through their parent-death signal,
  environment.die_with_launcher) keep the dir until they are gone;
- multi-node runs (whose node launchers share the dir), srun-adopted tasks and a user's own
  torchrun: global rank 0, in the worker; the other ranks take nothing;
- a launcher that submits and exits (`launcher=slurm` on the login node, kubernetes, Ray's
  submit=job): only checks (the job's rank 0 takes it later).

The launcher takes it exclusively, writes its line into the file, then downgrades to a shared
lock that the workers join; a contender asks for an exclusive lock, which fails while any of
them lives. On a filesystem without working `flock` (some NFS setups, Lustre without
`-o flock`) the run goes on unguarded, with a warning.

`RunDirLock` is also a Hydra callback (configs/hydra/default.yaml): `on_run_start` runs before
Hydra creates the run dir and writes `.hydra/` and `train.log`, so a refused run touches none of
the holder's files.

Holding the lock means no other process saves into the dir, so every temp file that a killed
save left there is stale: they are removed (checkpoint_temps.remove_stale_temps) when it is taken.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from accel_train import checkpoint_temps as ckpt_io
from accel_train.environment import in_srun_step, inside_torchrun
from accel_train.errors import UserError, report_user_errors
from accel_train.launchers.names import submits_and_exits

log = logging.getLogger("accel_train")

LOCK_NAME = ".lock"
# The lock file the launching process holds, for its torchrun workers to join.
ENV_VAR = "ACCEL_TRAIN_RUN_LOCK"
# flock errors that mean "this filesystem cannot lock", not "someone holds it".
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}

# The lock this process holds (one at a time: sweep jobs run one after the other in one
# process, each in its own dir), and the dirs whose stale temps were already cleared.
_held: _Held | None = None
_cleaned: set[Path] = set()


class _Held:
    def __init__(self, path: Path, fd: int | None, shared: bool):
        self.path, self.fd, self.shared = path, fd, shared

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


# ---- who takes the lock -------------------------------------------------------------------


def role(cfg: DictConfig) -> str:
    """What this process of this run does with the lock: "hold" (take it), "join" (share the
    launcher's), "check" (refuse if held, take nothing) or "skip"."""
    run_dir = Path(cfg.paths.output_dir).resolve()
    env = os.environ
    if inside_torchrun():
        if env.get(ENV_VAR) == str(run_dir / LOCK_NAME):
            return "join"  # a worker of a launcher that holds it
        return "hold" if env.get("RANK") == "0" else "skip"
    if submits_and_exits(cfg):
        return "check"  # the job's global rank 0 holds it
    if in_srun_step():  # mirrors launchers.slurm_job.adopt_srun_task
        nodes, ntasks = int(env["SLURM_JOB_NUM_NODES"]), int(env["SLURM_NTASKS"])
        if ntasks == nodes:  # one task per node: a node agent
            return "hold" if nodes == 1 else "skip"
        return "hold" if env.get("SLURM_PROCID") == "0" else "skip"
    return "hold" if str(cfg.launcher.nnodes) == "1" else "skip"


def hold_run_dir(cfg: DictConfig, clean: bool = True) -> None:
    """Take (or join, or check) the run dir's lock as this process's role says, then (`clean`)
    clear the stale temp files of killed saves. Raises UserError when a live run holds the
    dir."""
    what = role(cfg)
    run_dir = Path(cfg.paths.output_dir).resolve()
    if what == "skip":
        return
    if what == "check":
        check_free(run_dir)
        return
    locked = acquire(run_dir, shared=what == "join")
    if clean and what == "hold" and run_dir not in _cleaned:
        _cleaned.add(run_dir)
        for where in (run_dir, run_dir / "checkpoints"):
            for path in ckpt_io.remove_stale_temps(where, locked=locked):
                log.info("removed %s, left by a save that was killed", path)


# ---- the lock itself ----------------------------------------------------------------------


def acquire(run_dir: Path, shared: bool = False) -> bool:
    """Hold `<run_dir>/.lock` for the rest of this process (or until another run dir's lock is
    taken). Returns False when the filesystem cannot lock (the run goes on unguarded)."""
    global _held
    run_dir = Path(run_dir).resolve()
    path = run_dir / LOCK_NAME
    if _held is not None and _held.path == path:
        return _held.fd is not None
    if _held is not None:
        _held.release()  # the previous sweep job's dir: that job is over
        _held = None
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if shared:
            _flock(fd, fcntl.LOCK_SH, path)
            _append(fd, _holder_line("worker"))
        else:
            _flock(fd, fcntl.LOCK_EX, path)
            os.ftruncate(fd, 0)
            _append(fd, _holder_line("launcher"))
            # Shared from now on, so that this run's torchrun workers can join it; anyone
            # else's exclusive request still fails while one of us lives. (flock converts by
            # unlocking first: a contender that slips into that instant wins and we refuse.)
            _flock(fd, fcntl.LOCK_SH, path)
            os.environ[ENV_VAR] = str(path)
    except _Unsupported as err:
        os.close(fd)
        log.warning(
            "cannot lock %s (%s): this filesystem does not support flock, so nothing stops a "
            "second run from writing into the same run dir",
            path,
            err,
        )
        _held = _Held(path, None, shared)
        return False
    except BaseException:
        os.close(fd)
        raise
    _held = _Held(path, fd, shared)
    return True


def check_free(run_dir: Path) -> None:
    """Refuse if a live run holds `run_dir`, without taking the lock."""
    path = Path(run_dir).resolve() / LOCK_NAME
    if not path.is_file():
        return
    # Read-write: NFS emulates flock with POSIX locks, and an exclusive one needs a writable fd.
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        # Exclusive, as a run would ask for it: a holder keeps a shared lock (see acquire).
        _flock(fd, fcntl.LOCK_EX, path)
    except _Unsupported:
        pass
    finally:
        os.close(fd)


def release() -> None:
    global _held
    if _held is not None:
        _held.release()
        _held = None
    os.environ.pop(ENV_VAR, None)


class _Unsupported(Exception):
    pass


def _flock(fd: int, kind: int, path: Path) -> None:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        raise in_use(path) from None
    except OSError as err:
        if err.errno in _UNSUPPORTED:
            raise _Unsupported(err.strerror) from None
        raise


def _holder_line(kind: str) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    line = {"pid": os.getpid(), "host": socket.gethostname(), "started": started, "kind": kind}
    return json.dumps(line) + "\n"


def _append(fd: int, line: str) -> None:
    # One write at the end of the file: the launcher and its workers add a line each.
    os.lseek(fd, 0, os.SEEK_END)
    os.write(fd, line.encode())


def holders(path: Path) -> list[dict[str, Any]]:
    """The processes that wrote themselves into the lock file (the launcher first)."""
    rows = []
    with contextlib.suppress(OSError):
        for text in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(text)
                if isinstance(row, dict) and "pid" in row:
                    rows.append(row)
    return rows


def in_use(path: Path) -> UserError:
    """The one paragraph for a run dir that a live run holds."""
    run_dir = path.parent
    rows = holders(path)
    here = socket.gethostname()
    alive = [r for r in rows if r.get("host") != here or ckpt_io.pid_alive(int(r["pid"]))]
    if rows:
        first = rows[0]
        who = f"accel-train pid {first['pid']} on host {first.get('host', '?')}"
        who += f" (started {first['started']})" if first.get("started") else ""
        if first not in alive:
            others = ", ".join(str(r["pid"]) for r in alive) or "its child processes"
            who += f", which has exited; its workers ({others}) still hold it"
    else:
        who = "another process"
    pid = alive[0]["pid"] if alive else None
    stop = (
        f"stop that run (`kill -TERM {pid}` makes it checkpoint and exit) and continue it "
        "with `resume=auto`"
        if pid
        else "stop that run"
    )
    return UserError(
        f"the run dir {run_dir} is in use by {who}: two runs writing one run dir would "
        f"overwrite each other's checkpoints and metrics. Wait for it to finish, {stop}, or "
        "give this run another `hydra.run.dir`."
    )
    return True


# ---- the Hydra callback ---------------------------------------------------------------------


class RunDirLock(Callback):
    """Take the run dir's lock before Hydra writes anything into the dir (single runs; a sweep's
    jobs take theirs in the task, where a refusal is recorded as that job's failure)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _hold_before_hydra(config)


@report_user_errors
def _hold_before_hydra(config: DictConfig) -> None:
    # hydra.run.dir as run_job will compute it: its resolvers cache their value in this same
    # config object (run_stamp has use_cache=True), so both see the same dir. output_dir is
    # not set yet, so the task's view of paths.output_dir is built from it.
    run_dir = OmegaConf.select(config, "hydra.run.dir")
    if run_dir is None:
        return
    task = OmegaConf.masked_copy(config, ["paths", "launcher"])
    OmegaConf.update(task, "paths.output_dir", str(run_dir), force_add=True)
    # The temp files are cleared by launch()'s call, where the job's log (train.log) records it.
    hold_run_dir(task, clean=False)
