"""`loader=ray`: the input pipeline on a Ray cluster's CPUs, with the order kept here.

The training process decides the order exactly as `loader=torch` does (:class:`ShardedOrder`:
same seed, same indices, same per-sample draws); Ray actors on any node of the cluster hold the
split and turn each list of keys into a finished batch (data/remote/ray_pool.py). The batches come
back through Ray's object store in order, at most `loader.prefetch` per worker in flight, and
go to the device as the other loaders' do. Because the order and the random draws are fixed here, a
killed worker's batches are simply made again elsewhere, and a mid-epoch resume is the same as
with any loader: `epoch(epoch, start_batch)`.

One pool per training process (`loader.num_workers` actors), started at the first loader and
shared by the run's loaders (training, validation, test); it ends with the process, or with the
Ray it started (`loader.address` unset: a local Ray on 127.0.0.1 for the run).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from accel_train import ray_cluster
from accel_train.data.batch import to_device
from accel_train.data.remote.ray_pool import BatchMaker, PoolSettings, RayPool
from accel_train.errors import UserError

log = logging.getLogger("accel_train")

_session: dict[str, Any] = {}  # this process's connection and pool, keyed by their settings


def settings_of(loader_cfg: DictConfig, rank: int) -> PoolSettings:
    resources = OmegaConf.to_container(loader_cfg.resources, resolve=True) or {}
    return PoolSettings(
        num_workers=int(loader_cfg.num_workers),
        cpus_per_worker=float(loader_cfg.cpus_per_worker),
        resources={str(k): float(v) for k, v in resources.items()},
        prefetch=int(loader_cfg.prefetch),
        max_restarts=int(loader_cfg.max_restarts),
        retries=int(loader_cfg.retries),
        timeout_s=float(loader_cfg.timeout_s),
        # The process's global rank names its actors: several processes share a data rank
        # under tensor or pipeline parallelism, and under launcher=ray one namespace.
        rank=int(os.environ.get("RANK", rank)),
        runtime_env=OmegaConf.to_container(loader_cfg.runtime_env, resolve=True) or None,
    )


def pool_for(loader_cfg: DictConfig, rank: int) -> RayPool:
    """This process's pool: started (and Ray connected) by the first loader that asks."""
    settings = settings_of(loader_cfg, rank)
    # What the pool is made of (not the batch sizes, which the training and evaluation loaders
    # of one run may set apart): the same settings share one pool.
    where = OmegaConf.to_container(loader_cfg, resolve=True)
    key = repr((settings, *(where[k] for k in ("address", "object_store_mb", "runtime_env"))))
    if _session.get("key") == key:
        return _session["pool"]
    close_pool()
    ray = ray_cluster.import_ray("loader=ray")
    mb = loader_cfg.object_store_mb
    if mb and (ray.is_initialized() or loader_cfg.address is not None):
        log.info(not_applied_store(mb, ray.is_initialized(), loader_cfg.address))
    # (runtime_env goes on the actors' options, PoolSettings: it holds whoever started Ray)
    connection = ray_cluster.connect(
        ray,
        loader_cfg.address,
        key="loader.address",
        num_cpus=settings.num_workers * settings.cpus_per_worker,
        object_store_memory=int(mb * 2**20) if mb else None,
    )
    _session.update(key=key, connection=connection)
    pool = _session["pool"] = RayPool(ray, settings, connection.where)
    log.info(
        "loader=ray: %d data workers on %s, at most %d batches in flight (loader.prefetch=%d "
        "per worker): %s; a batch not back within loader.timeout_s=%g s stops the run with "
        "checkpoints/last.pt",
        settings.num_workers,
        connection.where,
        settings.in_flight,
        settings.prefetch,
        pool.describe(),
        settings.timeout_s,
    )
    return pool


def not_applied_store(mb: int, initialised: bool, address: str | None) -> str:
    """The one line for a loader.object_store_mb that cannot apply: the object store is sized
    by whoever starts Ray, and this run does not start it."""
    why = (
        "Ray was already running in this process (launcher=ray, or your own ray.init)"
        if initialised
        else f"the run joins the cluster at loader.address={address}"
    )
    return (
        f"loader=ray: loader.object_store_mb={mb} does not apply: {why}, whose object store was "
        "sized when it started (`ray start --object-store-memory`, or the launcher's own)."
    )


def close_pool() -> None:
    """End this process's pool and a Ray it started (at exit, or before another pool)."""
    pool, connection = _session.pop("pool", None), _session.pop("connection", None)
    _session.clear()
    if pool is not None:
        pool.close()
    if connection is not None:
        connection.close()


atexit.register(close_pool)


def check_travels(split, maker: BatchMaker) -> None:
    """The split pickled, or one paragraph naming it: a split that cannot travel to the Ray
    workers (an open file or lock, a generator, a lambda pickle cannot follow)."""
    ray = ray_cluster.import_ray("loader=ray")
    try:
        ray.cloudpickle.dumps(maker)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError) as err:
        raise UserError(
            f"loader=ray sends the data set to Ray workers on other processes and nodes, and "
            f"the {type(split).__name__} split cannot be pickled ({ray_cluster.one_line(err)}). "
            "Make it picklable (open files and connections in __getitem__ or __setstate__, "
            "not in __init__), or use `loader=torch`."
        ) from None


class RayLoader:
    """A ShardedOrder's batches made by this process's Ray pool (same interface as the
    other loaders: epoch(), order, close(), and metrics() for the speed metrics)."""

    def __init__(self, split, items, collate, order, loader_cfg: DictConfig, device, rank: int):
        self.order, self.device = order, device
        self.pin = bool(loader_cfg.pin_memory) and device.type == "cuda"
        maker = BatchMaker(items, collate)
        check_travels(split, maker)
        self.pool = pool_for(loader_cfg, rank)
        # The split goes into the object store once; every worker fetches it once.
        self.maker_ref = self.pool.ray.put(maker)

    def __len__(self) -> int:
        return len(self.order)

    def close(self) -> None:
        pass  # the pool is shared by the process's loaders: close_pool() ends it

    def metrics(self) -> dict[str, float]:
        return self.pool.metrics()

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator:
        self.order.set_epoch(epoch, start_batch)
        for batch in self.pool.ordered(self.maker_ref, iter(self.order)):
            if self.pin:
                batch = _pinned(batch)
            yield to_device(batch, self.device)  # pinned memory: asynchronous copies


def _pinned(batch):
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, tuple | list):
        return type(batch)(_pinned(b) for b in batch)
    return batch
