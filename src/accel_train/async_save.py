"""checkpoint.async_save=true: a checkpoint is copied and written while training goes on.

A save hands the state to `HostStager` (an AsyncStager of torch.distributed.checkpoint), which
copies every tensor into host memory on a thread of its own: pinned memory on CUDA, and buffers
cached from one save to the next, so that a save after the first allocates nothing (on the CPU
the page faults of a fresh 200 MB copy cost more than the copy). Why not torch's DefaultStager:
it copies with UntypedStorage.copy_, which holds the GIL for the whole copy, so the training
thread stalled for it (25 ms per 200 MB on a 2-core CPU); Tensor.copy_ releases the GIL.

The loop goes on with the next step's forward and backward meanwhile and waits for the copy
only where the weights would change under it: before the optimizer step, a validation, the next
save or the exit (`staged`). What else the forward pass may change (a BatchNorm's running
statistics, a technique's counters) is copied before `_save` returns: only the parameters and
the optimizer state, which nothing but the optimizer step changes, are left to the background
copy.

Then one background thread writes the copy: the single-file checkpoint with
checkpoint.atomic_save, a sharded one through torch.distributed.checkpoint.async_save on a process
group of its own (its collectives must not interleave with the training step's). The same atomic
rule as a synchronous save: the file or directory appears under its name by a rename once
complete, so a kill at any moment leaves the previous checkpoint loadable.

At most one save is in flight: the next one waits for it. The loop logs, per save, the time it
was blocked (`checkpoint/blocked_s`: the call, plus the wait for the copy at the next weight
change) and the time it waited for the previous write (`checkpoint/waited_s`). The loop waits for
the last write before it validates the best checkpoint, exits or stops for a requeue; a failed
write is raised there, as the same one-paragraph UserError a synchronous save raises.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor


class HostStager(AsyncStager):
    """Copies a state's tensors (nested dicts, lists, tuples; DTensors by their local shard)
    into host buffers on a thread of its own. The buffers are kept per place in the state, so
    a save after the first allocates nothing; one save at a time (the caller waits)."""

    _synchronize_after_execute = False  # dcp.async_save: the future says when it is done

    def __init__(self, cuda: bool):
        self.pin = cuda  # pinned buffers and non-blocking copies on a stream of its own
        self._stream = torch.cuda.Stream() if cuda else None
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accel-stage")

    def stage(self, state_dict: Any, **kwargs: Any) -> Future:
        return self._pool.submit(self._stage, state_dict)

    def _stage(self, state: Any) -> Any:
        stream = torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext()
        with torch.no_grad(), stream:
            staged = self._copy(state, ())
        if self._stream is not None:
            self._stream.synchronize()  # the non-blocking copies are complete
        return staged

    def _copy(self, obj: Any, path: tuple) -> Any:
        if isinstance(obj, DTensor):  # the same layout, this rank's shard in host memory
            local = self._copy(obj.to_local(), path)
            return DTensor(local, obj._spec, requires_grad=False)  # noqa: SLF001
        if isinstance(obj, torch.Tensor):
            key = (path, obj.dtype, tuple(obj.shape))
            buffer = self._buffers.get(key)
            if buffer is None:
                buffer = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=self.pin)
                self._buffers[key] = buffer
            return buffer.copy_(obj.detach(), non_blocking=self.pin)
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, (*path, i)) for i, v in enumerate(obj))
        return obj

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._buffers.clear()


class AsyncSaver:
    """The stager (host copies in the background) and one background writer."""

    def __init__(self, group=None, cuda: bool = False):
        self.group = group  # the process group of sharded saves (None: one process)
        self.cuda = cuda
        self.stager = HostStager(cuda)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accel-ckpt")
        self._staging: Future | None = None
        self._pending: Future | None = None

    def begin(self) -> None:
        """Before a save's state is read: on CUDA the step's kernels are complete (the stager
        copies on a stream of its own, which does not wait for the compute stream)."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()  # HOST SYNC (checkpoint step)

    def staged(self) -> float:
        """Block until the host copy of the last save's state is complete: call before anything
        changes the weights or the optimizer state. Returns the seconds waited."""
        if self._staging is None:
            return 0.0
        start = time.perf_counter()
        staging, self._staging = self._staging, None
        with contextlib.suppress(Exception):  # a failed copy is raised by wait(), with the write
            staging.result()
        return time.perf_counter() - start

    def wait(self) -> float:
        """Block until the save in flight (if any) is written; its error is raised here.
        Returns the seconds waited."""
        start = time.perf_counter()
        self.staged()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
        return time.perf_counter() - start

    def save_file(self, state: dict[str, Any], write: Callable[[dict[str, Any]], None]) -> None:
        """Copy `state` in the background, then `write(copy)` (call wait() first)."""
        assert self._pending is None, "wait() for the previous save first"
        staging = self.stager.stage(state)
        self._staging = staging
        self._pending = self._pool.submit(lambda: write(staging.result()))

    def submit(self, write: Callable[[], None], staging: Future | None = None) -> None:
        """Run `write` in the background; `staging`: the copy it writes, which staged() waits
        for (a sharded save's, started by dcp.async_save with this saver's stager)."""
        assert self._pending is None, "wait() for the previous save first"
        self._staging = staging
        self._pending = self._pool.submit(write)

    def close(self) -> None:
        """Wait for the last write, then stop the threads."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            self.stager.close()
