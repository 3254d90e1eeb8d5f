"""checkpoint.async_save=true: a checkpoint is written while training goes on.

The loop stages the state (a copy of every tensor in host memory, pinned on CUDA: the training
step may change the weights the moment `_save` returns), then one background thread writes it:
the single-file checkpoint with checkpoint.atomic_save, a sharded one through
torch.distributed.checkpoint.async_save on a process group of its own (its collectives must not
interleave with the training step's). The same atomic rule as a synchronous save: the file or
directory appears under its name by a rename once complete, so a kill at any moment leaves the
previous checkpoint loadable.

At most one save is in flight: the next one waits for it (the time waited is part of the
`checkpoint/blocked_s` the loop logs). The loop waits for the last one before it validates the
best checkpoint, exits or stops for a requeue; a failed write is raised there, as the same
one-paragraph UserError a synchronous save raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


def stage(obj: Any, pin: bool) -> Any:
    """A copy of `obj` (nested dicts, lists, tuples) whose tensors live in host memory and are
    no longer shared with the model or optimizer."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type == "cpu":
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        return out.copy_(t, non_blocking=pin)
    if isinstance(obj, dict):
        return {k: stage(v, pin) for k, v in obj.items()}
    if isinstance(obj, list):
        return [stage(v, pin) for v in obj]
    if isinstance(obj, tuple):
        return tuple(stage(v, pin) for v in obj)
    return obj


class AsyncSaver:
    """One background writer; `submit` waits for the previous write first."""

    def __init__(self, group=None):
        self.group = group  # the process group of sharded saves (None: one process)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accel-ckpt")
        self._pending: Future | None = None

    def wait(self) -> float:
        """Block until the write in flight (if any) is complete; its error is raised here.
        Returns the seconds waited."""
        if self._pending is None:
            return 0.0
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        pending.result()
        return time.perf_counter() - start

    def submit(self, write: Callable[[], None]) -> None:
        """Run `write` in the background (call wait() first: one save in flight)."""
        assert self._pending is None, "wait() for the previous save first"
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the staged copies (non-blocking) are complete
        self._pending = self._pool.submit(write)

    def close(self) -> None:
        """Wait for the last write, then stop the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
