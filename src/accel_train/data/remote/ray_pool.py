"""The Ray actors behind `loader=ray`: a pool that turns lists of (epoch, index) keys into
finished batches, in order, and survives the loss of its workers.

Each actor (class `AccelTrainDataWorker`, actor name `accel-train-data-<rank>-<i>`: `ray list
actors` and the process titles show them) reads a split once from the object store and then
runs, for every key list it is sent, exactly what a `loader=torch` worker runs: the split's
items (`getitem(i, epoch)`: augmentation seeded by seed, epoch and index) and its collate. The
batches are therefore bit for bit the ones `loader=torch` gives, whichever actor made them.

Fault tolerance: the trainer keeps every key list it sent until the batch is back. A worker that
dies (SIGKILL, its node lost) fails the calls it held; each is sent again, to the next worker
(Ray restarts the dead one, `loader.max_restarts` times), so nothing is skipped or seen twice.
A batch not back within `loader.timeout_s` seconds, or failed `loader.retries` times, raises
:class:`~accel_train.errors.DataSourceLost`: the loop saves last.pt and stops.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from accel_train.errors import DataSourceLost, UserError

log = logging.getLogger("accel_train")

ACTOR_PREFIX = "accel-train-data"


class AccelTrainDataWorker:
    """One data worker (wrapped by `ray.remote` when the pool starts). Holds the splits it was
    sent (by object-store reference, fetched once) and makes batches from key lists."""

    def __init__(self, name: str):
        self.name = name
        self.makers: dict[str, Any] = {}
        # Ctrl-C reaches the terminal's whole process group: the trainer checkpoints on it and
        # then ends the pool itself; a worker that died of it would only cost a resubmission.
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def where(self) -> tuple[str, int, str]:
        return self.name, os.getpid(), socket.gethostname()

    def batch(self, maker_ref: list, keys: list[tuple[int, int]]):
        """(the collated batch, seconds of work) or ("error", a UserError's paragraph)."""
        start = time.perf_counter()
        ref = maker_ref[0]  # in a list, so Ray passes the reference and not the value
        maker = self.makers.get(ref.hex())
        try:
            if maker is None:  # (ray is importable here: this runs in a Ray worker)
                maker = self.makers[ref.hex()] = importlib.import_module("ray").get(ref)
        except Exception as err:  # noqa: BLE001 - said in one paragraph by the trainer
            return "error", cannot_load(self.name, err)
        try:
            batch = maker.make(keys)
        except UserError as err:  # a bad label, an unreadable image: the trainer says it
            return "error", str(err)
        return batch, time.perf_counter() - start


def cannot_load(name: str, err: BaseException) -> str:
    cause = getattr(err, "cause", None) or err  # Ray wraps what unpickling raised
    text = " ".join(str(cause).split())[:300]
    return (
        f"loader=ray: the data worker {name} could not load the data set "
        f"({type(cause).__name__}: {text}). The workers import the data set's code by name: on "
        "a cluster, install it on every node, or send it with `loader.runtime_env` (e.g. "
        "`+loader.runtime_env.working_dir=.`)."
    )


@dataclass
class BatchMaker:
    """What a worker needs to make a batch of one split: the items and the collate."""

    items: Any  # loaders._Items over the split
    collate: Any

    def make(self, keys: list[tuple[int, int]]):
        batch = self.collate([self.items[k] for k in keys])
        return as_arrays(tuple(batch) if isinstance(batch, list) else batch)


# Tensors travel as numpy arrays: Ray reads those straight out of the object store (no
# unpickling of torch storages), and the trainer makes one copy of the bytes (as_tensors):
# 2.0 ms against 5.2 ms of the trainer's CPU for a batch of 64 x 3 x 224 x 224 uint8.
class _Array:
    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array


def as_arrays(batch):
    if isinstance(batch, torch.Tensor):
        return _Array(batch.numpy()) if batch.dtype != torch.bfloat16 else batch
    if isinstance(batch, dict):
        return {k: as_arrays(v) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(as_arrays(v) for v in batch)
    return batch


def as_tensors(batch):
    """The batch back as tensors, each copied out of the (read-only) object store once."""
    if isinstance(batch, _Array):
        return torch.from_numpy(np.array(batch.array, copy=True))
    if isinstance(batch, dict):
        return {k: as_tensors(v) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(as_tensors(v) for v in batch)
    return batch


@dataclass
class _Job:
    """A batch in flight: its keys (kept to send again), its result's reference, its worker."""

    keys: list[tuple[int, int]]
    ref: Any
    worker: int
    failures: int = 0


@dataclass
class PoolSettings:
    num_workers: int
    cpus_per_worker: float
    resources: dict[str, float]
    prefetch: int
    max_restarts: int
    retries: int
    timeout_s: float
    rank: int = 0
    names: list[str] = field(default_factory=list)
    runtime_env: dict[str, Any] | None = None  # loader.runtime_env, on each actor's options

    @property
    def in_flight(self) -> int:
        """Batches in flight: `prefetch` per worker (as Ray Data's and tf.data's prefetch),
        so every worker has work while the trainer reads the oldest."""
        return max(self.prefetch, 1) * max(self.num_workers, 1)


class RayPool:
    """The actors of one training process, started once and shared by its loaders."""

    def __init__(self, ray, settings: PoolSettings, where: str):
        self.ray, self.s, self.where = ray, settings, where
        remote = ray.remote(AccelTrainDataWorker)
        self.actors = []
        for i in range(settings.num_workers):
            name = f"{ACTOR_PREFIX}-{settings.rank}-{i}"
            options: dict[str, Any] = {
                "name": name,
                "num_cpus": settings.cpus_per_worker,
                "max_restarts": settings.max_restarts,
                "max_task_retries": 0,  # the pool resubmits itself, to another worker
            }
            if settings.resources:
                options["resources"] = dict(settings.resources)
            if settings.runtime_env:
                # On the actors, not only ray.init: it then holds when Ray was initialised
                # before the loader (launcher=ray), where ray.init's would be ignored.
                options["runtime_env"] = dict(settings.runtime_env)
            actor = remote.options(**options).remote(name)
            self.actors.append(actor)
            settings.names.append(name)
        self.next_worker = 0
        self.images = 0  # samples made by the pool (all loaders of this process)
        self.busy_s = 0.0  # seconds the workers spent making them
        self.resubmitted = 0  # batches sent again after their worker died
        self._mark = (time.perf_counter(), 0, 0.0)

    def put(self, maker: BatchMaker):
        return self.ray.put(maker)

    def describe(self) -> str:
        """The workers' names, pids and hosts (waits for them to start: at most timeout_s)."""
        try:
            found = self.ray.get([a.where.remote() for a in self.actors], timeout=self.s.timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise DataSourceLost(self._not_started()) from None
        return ", ".join(f"{name} (pid {pid} on {host})" for name, pid, host in found)

    def _not_started(self) -> str:
        need = {"CPU": self.s.cpus_per_worker, **self.s.resources}
        return (
            f"loader=ray: the {self.s.num_workers} data workers did not start within "
            f"loader.timeout_s={self.s.timeout_s:g} s on {self.where}: each asks for "
            f"{', '.join(f'{v:g} {k}' for k, v in need.items())}, which the cluster may not "
            "have free (`ray status` shows it). Add nodes, or lower loader.num_workers, "
            "loader.cpus_per_worker or loader.resources."
        )

    # ---- batches, in order ------------------------------------------------------------------

    def ordered(self, maker_ref, key_lists: Iterable[list]) -> Iterator[Any]:
        """The batches of `key_lists`, in order, at most loader.prefetch per worker in flight."""
        pending: deque[_Job] = deque()
        limit = max(self.s.prefetch, 1) * max(len(self.actors), 1)
        for keys in key_lists:
            if len(pending) >= limit:
                yield self._collect(maker_ref, pending.popleft())
            pending.append(self._submit(maker_ref, keys))
        while pending:
            yield self._collect(maker_ref, pending.popleft())

    def _submit(self, maker_ref, keys, failures: int = 0) -> _Job:
        i = self.next_worker
        self.next_worker = (i + 1) % len(self.actors)
        ref = self.actors[i].batch.remote([maker_ref], keys)
        return _Job(keys, ref, i, failures)

    def _collect(self, maker_ref, job: _Job):
        exceptions = self.ray.exceptions
        lost = (exceptions.RayActorError, exceptions.ObjectLostError)
        while True:
            try:
                out = self.ray.get(job.ref, timeout=self.s.timeout_s)
            except exceptions.GetTimeoutError:
                raise DataSourceLost(self._timed_out()) from None
            except lost as err:
                job = self._resubmit(maker_ref, job, err)
                continue
            break
        batch, busy = out
        if isinstance(batch, str):  # "error": the worker's one paragraph
            raise UserError(busy)
        self.busy_s += busy
        self.images += len(job.keys)
        return as_tensors(batch)

    def _resubmit(self, maker_ref, job: _Job, err: BaseException) -> _Job:
        if job.failures >= self.s.retries:
            raise DataSourceLost(
                f"loader=ray: a batch failed {job.failures + 1} times, each time because its "
                f"data worker died (loader.retries={self.s.retries}; the last: "
                f"{type(err).__name__}). The Ray cluster at {self.where} is losing its workers "
                "faster than it restarts them (loader.max_restarts="
                f"{self.s.max_restarts}): see `ray status` and Ray's logs."
            )
        self.resubmitted += 1
        dead = self.s.names[job.worker]
        new = self._submit(maker_ref, job.keys, job.failures + 1)
        if new.worker == job.worker and len(self.actors) > 1:  # not the same one again
            new = self._submit(maker_ref, job.keys, job.failures + 1)
        log.warning(
            "loader=ray: data worker %s died (%s); its batch goes to %s",
            dead,
            type(err).__name__,
            self.s.names[new.worker],
        )
        return new

    def _timed_out(self) -> str:
        return (
            f"loader=ray: no batch came back from the Ray data workers on {self.where} within "
            f"loader.timeout_s={self.s.timeout_s:g} s: the cluster (or every worker and its "
            "node) is gone or stalled: check it with `ray status`, and raise loader.timeout_s "
            "if a batch can legitimately take that long."
        )

    # ---- metrics --------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """The pool's images/s and busy share since the last call (logging steps)."""
        now = time.perf_counter()
        then, images, busy = self._mark
        self._mark = (now, self.images, self.busy_s)
        seconds = now - then
        if seconds <= 0:
            return {}
        return {
            "data/remote_images_per_s": (self.images - images) / seconds,
            "data/remote_busy_share": (self.busy_s - busy) / (seconds * len(self.actors)),
            "data/resubmitted": float(self.resubmitted),
        }

    def close(self) -> None:
        # At exit Ray's own hook may have disconnected first (the actors went with it); a
        # call now would start a new local Ray.
        if self.ray.is_initialized():
            for actor in self.actors:
                # (an actor already gone with its cluster: nothing to end)
                with contextlib.suppress(Exception):
                    self.ray.kill(actor)
        self.actors = []
