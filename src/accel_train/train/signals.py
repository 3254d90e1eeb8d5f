"""Signals that ask a run to stop cleanly: set a flag the loop reads at its next step.

SIGUSR1 is what SLURM sends before the time limit (`--signal=USR1@grace`) and what
`scancel --signal=USR1` and the torchrun agents forward; the loop checkpoints at the next step
and returns status "preempted". Handlers are only installed in the main thread (Python allows
no other), and the previous handlers come back afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger("accel_train")

STOP_SIGNALS = (signal.SIGUSR1,)


class StopRequest:
    def __init__(self, rank: int):
        self.rank = rank
        self.requested = False

    def _handle(self, signum, frame) -> None:
        self.requested = True
        name = signal.Signals(signum).name
        log.warning("rank %d: %s received, checkpointing at the next step", self.rank, name)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
