"""Signals that ask a run to stop cleanly: set a flag the loop reads at its next step.

- SIGUSR1 is what SLURM sends before the time limit (`--signal=USR1@grace`) and what
  `scancel --signal=USR1` and the torchrun agents forward: the loop checkpoints at the next step
  and returns status "preempted"; the launch side may requeue the job.
- SIGTERM (`docker stop`, `kill`, SLURM cancelling or requeueing a job, the torchrun agent
  shutting its workers down) and SIGINT (Ctrl-C): the loop checkpoints at the next step and the
  process exits with 128 + the signal number (143, 130), as a process killed by the signal would
  report it, after one log line that says where the checkpoint is. No requeue: under SLURM a
  SIGTERM means the job is being cancelled or requeued by SLURM itself.
- A second SIGINT (Ctrl-C pressed again while waiting for the checkpoint) exits at once, with
  status 130 and no traceback; a third one gets Python's default handling back.
- In a job of Hydra's submitit launcher on SLURM (`hydra/launcher=submitit_slurm`), submitit's
  own preemption signal (SIGUSR2 unless $SUBMITIT_PREEMPT_SIGNAL says otherwise; its sbatch
  script asks for `--signal=USR2@<signal_delay_s>`) is a stop like SIGUSR1. submitit would act
  on it at once, mid-step, with no checkpoint: here the loop saves last.pt first, and the launch
  side then hands the signal to submitit's handler, which requeues the job
  (launchers/slurm_job.py). A preemption can come as SIGTERM and that signal together (submitit
  ignores SIGTERM for this reason): the preemption signal wins, in either order, so the job is
  requeued rather than ended; after a SIGTERM alone the launch side waits a while for it
  (commands/sweep.py).

One process reads its flag after every optimizer step; several processes agree at the next
logging step (train/loop.py), so under torchrun the stop takes at most `log_every_n_steps` steps
plus the save. torchrun's agent gives its workers `--shutdown_timeout` (30 s by default, then
SIGKILL) after forwarding SIGTERM/SIGINT, SLURM gives `KillWait` (30 s by default) and
`docker stop` 10 s: keep `trainer.log_every_n_steps` short enough that the stop fits.

Handlers are only installed in the main thread (Python allows no other), and the previous
handlers come back afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger("accel_train")

# The signals that end a run with a checkpoint and an exit status of 128 + signum.
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_SIGNALS = (signal.SIGUSR1, *EXIT_SIGNALS)


_submitit_signal_received = False  # set by StopRequest: see submitit_signal_received()


def submitit_signal_received() -> bool:
    """Whether a StopRequest caught submitit's preemption signal in this process (then
    submitit's own handler never saw it: the launch side must hand it over)."""
    return _submitit_signal_received


def submitit_preempt_signal() -> signal.Signals | None:
    """The signal submitit treats as preemption or the time limit, in a job that submitit
    started on SLURM (its sbatch script exports SUBMITIT_EXECUTOR=slurm); None elsewhere.
    Read as submitit.JobEnvironment.USR_SIG reads it, without importing submitit."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return None
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return getattr(signal.Signals, f"SIG{name}", None)


class Stopped(SystemExit):
    """Raised after the stop checkpoint (or at once on a second Ctrl-C): exit status 128 +
    signum and no traceback. A SystemExit, so `except Exception` in user code or in a sweep job
    does not swallow it (Lightning's SIGTERMException is one too)."""

    def __init__(self, signum: int):
        super().__init__(128 + int(signum))
        self.signum = int(signum)


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum is not None else "a stop signal"


class StopRequest:
    def __init__(self, rank: int, every_step: bool = True):
        self.rank = rank
        self.every_step = every_step  # one process checks every step; several at logging steps
        self.requested = False
        self.signum: int | None = None  # the signal that decides how the run ends
        self.interrupts = 0  # SIGINTs received: the second one exits at once
        self.submitit_signal = submitit_preempt_signal()  # None outside a submitit SLURM job
        self._pid: int | None = None

    @property
    def exits(self) -> bool:
        """Stop by exiting (SIGTERM/SIGINT), not by returning "preempted" (SIGUSR1, or
        submitit's preemption signal in a submitit job, even if that is one of them)."""
        return self.signum in EXIT_SIGNALS and self.signum != self.submitit_signal

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            # A DataLoader worker forked from the trainer inherits this handler and gets the
            # same SIGINT (terminal) or SIGTERM (SLURM signals every process of the step, the
            # torchrun agent signals each worker's process group). It keeps serving batches
            # until the trainer has checkpointed and closes it.
            return
        name = signal.Signals(signum).name
        if signum == self.submitit_signal:
            global _submitit_signal_received
            _submitit_signal_received = True
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                # Ctrl-C again: the user does not want to wait for the checkpoint. Python's
                # default handler comes back, so a third Ctrl-C interrupts even code that
                # swallowed this SystemExit.
                signal.signal(signal.SIGINT, signal.default_int_handler)
                log.warning(
                    "rank %d: SIGINT again: exiting now without a new checkpoint", self.rank
                )
                raise Stopped(signum)
        if self.submitit_signal is not None and self.requested:
            if signum == self.submitit_signal and self.signum == signal.SIGTERM:
                # A preemption that came as SIGTERM first: requeue (through submitit), not exit.
                self.signum = signum
                log.log(
                    logging.WARNING if self.rank == 0 else logging.INFO,
                    "rank %d: %s received: the job is requeued after the checkpoint",
                    self.rank,
                    name,
                )
                return
            if signum == signal.SIGTERM and self.signum == self.submitit_signal:
                return  # the SIGTERM of the same preemption: the requeue stands
        if self.requested and (self.exits or signum not in EXIT_SIGNALS):
            # Already stopping: SLURM signals every process of a step and the torchrun agent
            # forwards the same signal again, so duplicates are normal and change nothing.
            return
        # SIGTERM/SIGINT after a SIGUSR1 turn the requeue into an exit (the job is going away).
        self.requested, self.signum = True, signum
        when = "at the next step" if self.every_step else "at the next logging step"
        again = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
        then = "and exiting" if self.exits else "and stopping"
        # Every rank gets the signal; rank 0 says so, the others only into their logs.
        level = logging.WARNING if self.rank == 0 else logging.INFO
        log.log(
            level, "rank %d: %s received: checkpointing %s %s%s", self.rank, name, when, then, again
        )

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._pid = os.getpid()
        signals = (*STOP_SIGNALS, *([self.submitit_signal] if self.submitit_signal else []))
        # (submitit's handler for its signal comes back afterwards: the launch side calls it.)
        previous = {s: signal.signal(s, self._handle) for s in dict.fromkeys(signals)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
