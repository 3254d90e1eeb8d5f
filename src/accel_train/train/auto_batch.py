"""loader.batch_size=auto: probe powers of two with real training steps before the loaders are
built, then train with the chosen size (written into the run's config.yaml and so into every
checkpoint).

- The probe builds its own copy of the model (with the model transforms that change memory:
  activation checkpointing, channels_last; not the DDP/FSDP wrap, not compile), loss, optimizer
  and precision from the config, and runs forward + backward + optimizer step on real training
  samples at 2, 4, 8, ... up to `loader.max_batch_size` (and the training samples per process).
  The copy is dropped afterwards and the run is built from its seed as usual: the probe leaves
  no trace (a run with `loader.batch_size=auto` trains exactly like one given the chosen size).
- CUDA: the largest size whose peak reserved memory stays under `trainer.memory_fraction` of the
  device. An out-of-memory error is caught and freed; the step has no collective (the model is
  not wrapped), and every size ends with one all-reduce of (failed, seconds), so all ranks see
  the same outcome and stop at the same size: no rank waits in a collective another rank
  skipped. (This path cannot run on this project's CPU-only CI; it is guarded by the device.)
- CPU: the size with the most samples/s whose peak RSS (VmHWM, reset per size) stays under
  `trainer.memory_fraction` of what this process may use (its RSS plus its share of
  MemAvailable); among sizes within 5% of the best, the smallest (timing noise on a shared
  machine should not buy a bigger batch). Probing stops after two sizes without a gain.
- `trainer.global_batch_size`: only sizes that divide it are probed, and
  trainer.accumulate_grad_batches is set to keep batch x accumulation x processes at it (the
  learning rate and its linear scaling stay those of that global batch).
- Without trainer.global_batch_size, a chosen size that leaves fewer than FEW_STEPS optimizer
  steps an epoch is warned about: the probe picks for speed, not for the recipe's step count.
- The table goes to <run dir>/batch_size_probe.csv. A resume never probes: it takes the size
  (and accumulation) recorded in the checkpoint's config.
"""

from __future__ import annotations

import csv
import gc
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.data import default_collate

from accel_train.config.run_config import write_run_config
from accel_train.data.batch import to_device
from accel_train.data.build import build_splits
from accel_train.data.transform import BatchTransform
from accel_train.errors import UserError
from accel_train.models import build_model
from accel_train.optim import build_optimizer
from accel_train.parallel import DistEnv
from accel_train.precision import resolve_precision
from accel_train.strategies import strategy_for
from accel_train.tasks import TaskContext, build_task, split_output
from accel_train.techniques import PARALLEL, BuildContext
from accel_train.train.build import build_techniques, seed_everything
from accel_train.train.evaluate import sample_batch
from accel_train.train.found import find_checkpoint, read_checkpoint

log = logging.getLogger("accel_train")

PROBE_NAME = "batch_size_probe.csv"
WARMUP_STEPS, TIMED_STEPS = 1, 3  # per size: one untimed step (allocations), then the median
NEAR_BEST = 0.95  # CPU: a size within 5% of the best samples/s counts as as fast
PATIENCE = 2  # CPU: stop after this many sizes without a gain
# Fewer optimizer steps an epoch than this with a probed size and no trainer.global_batch_size:
# warn. The probe maximises samples/s; on a GPU that is often the largest batch that fits, which
# on a small data set leaves a handful of steps an epoch (gpu_check: 1,024 of 4,500 images).
FEW_STEPS = 20


def resolve_batch_size(cfg: DictConfig, env: DistEnv) -> None:
    """Replace loader.batch_size=auto in `cfg` (in place) by the recorded or probed size."""
    if cfg.loader.batch_size != "auto":
        return
    recorded = _recorded(cfg)
    if recorded is not None:
        cfg.loader.batch_size, cfg.trainer.accumulate_grad_batches = recorded
        if env.is_main:
            log.info(
                "loader.batch_size=auto: %d (x %d accumulation), as recorded in the checkpoint "
                "resumed from (not probed again)",
                *recorded,
            )
            write_run_config(cfg, Path(cfg.paths.output_dir))
        return
    rows, chosen, per_process = probe(cfg, env)
    accum = cfg.trainer.accumulate_grad_batches
    if cfg.trainer.global_batch_size:
        accum = cfg.trainer.global_batch_size // (chosen * env.world_size)
    steps = per_process // (chosen * accum)
    if env.is_main and not cfg.trainer.global_batch_size and steps < FEW_STEPS:
        log.warning(
            "loader.batch_size=auto chose %d: an epoch of %d samples per process is only %d "
            "optimizer step(s). The probe maximises samples/s, not accuracy per step: set "
            "`trainer.global_batch_size=<the batch the learning rate was tuned for>` (the probe "
            "then picks only the per-device size and the accumulation), or cap "
            "`loader.max_batch_size`",
            chosen,
            per_process,
            steps,
        )
    cfg.loader.batch_size, cfg.trainer.accumulate_grad_batches = chosen, accum
    if env.is_main:
        run_dir = Path(cfg.paths.output_dir)
        _write_table(rows, run_dir / PROBE_NAME)
        write_run_config(cfg, run_dir)
        log.info(
            "loader.batch_size=auto: %d (x %d accumulation x %d process(es)); probe table in %s",
            chosen,
            accum,
            env.world_size,
            run_dir / PROBE_NAME,
        )


def _recorded(cfg: DictConfig) -> tuple[int, int] | None:
    """(batch size, accumulation) of the checkpoint this run resumes from, if any."""
    ckpt_dir = Path(cfg.paths.output_dir) / "checkpoints"
    path = find_checkpoint(cfg.resume, ckpt_dir, strategy_for(cfg).checkpoint_suffix(True))
    if path is None:
        return None
    old = read_checkpoint(path)["config"]
    size = old["loader"]["batch_size"]
    return (size, old["trainer"]["accumulate_grad_batches"]) if size != "auto" else None


# ---- the probe -------------------------------------------------------------------------------


def candidates(cfg: DictConfig, num_train: int, world: int) -> list[int]:
    """Powers of two from 2 up to loader.max_batch_size and the training samples per process
    (dividing trainer.global_batch_size / processes when that is set)."""
    cap = min(cfg.loader.max_batch_size, num_train // world)
    sizes = [2**k for k in range(1, 31) if 2**k <= cap]
    target = cfg.trainer.global_batch_size
    if target:
        sizes = [s for s in sizes if target % (s * world) == 0]
    if not sizes:
        why = f"trainer.global_batch_size={target} / {world} process(es)" if target else ""
        raise UserError(
            f"loader.batch_size=auto: no power of two from 2 to {cap} (loader.max_batch_size="
            f"{cfg.loader.max_batch_size}, {num_train} training samples / {world} process(es))"
            f"{' divides ' + why if why else ''}. Raise loader.max_batch_size"
            f"{', or make trainer.global_batch_size a multiple of 2 x processes' if why else ''}"
            ", or give `loader.batch_size` a number."
        )
    return sizes


class _Probe:
    """The model, loss, optimizer and precision a training step uses, built for the probe."""

    def __init__(self, cfg: DictConfig, env: DistEnv):
        t = cfg.trainer
        self.env, self.device = env, env.device
        techniques = build_techniques(cfg)
        for technique in techniques:
            technique.before_build()
        seed_everything(t.seed, t.deterministic)
        self.precision = resolve_precision(cfg.precision.name, env.device, cfg.precision.tf32)
        self.task = build_task(cfg)
        self.splits = build_splits(
            cfg.dataset, cfg.paths.data_dir, self.task.labelled_data, cfg.task
        )
        self.transform = BatchTransform(
            cfg.dataset, self.splits, env.device, self.precision.param_dtype, seed=t.seed, rank=0
        )
        module = build_model(cfg.model, self.splits.data_args, self.precision.param_dtype)
        module = module.to(env.device, dtype=self.precision.param_dtype)
        ctx = TaskContext(
            cfg,
            env.device,
            self.splits.data_args,
            self.transform,
            module,
            sample_batch(self.splits, env.device),
            augment=True,
        )
        self.task.setup(ctx)
        batch = ctx.prepared(self.task)
        build_ctx = BuildContext(
            cfg, env, self.transform, self.task.inputs(batch), self.task, batch
        )
        for technique in sorted(techniques, key=lambda t: t.order):
            if technique.order < PARALLEL:  # what changes memory; no wrap, no compile
                module = technique.transform(module, build_ctx)
        self.model = module.train()
        # (frozen parameters: no state, as in training)
        self.optimizer = build_optimizer(module, cfg.optimizer, cfg.optimizer.lr, env.device)
        self.scaler = self.precision.grad_scaler()

    def batch(self, size: int) -> Any:
        n = len(self.splits.train)
        collate = getattr(self.splits.train, "collate", None) or default_collate  # decode=gpu
        batch = collate([self.splits.train[i % n] for i in range(size)])
        batch = to_device(tuple(batch) if isinstance(batch, list) else batch, self.device)
        return self.task.prepare(batch, train=True)

    def step(self, batch: Any) -> None:
        with self.precision.autocast():
            loss, _, _ = split_output(self.task.step(self.model, batch))
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


def probe(cfg: DictConfig, env: DistEnv) -> tuple[list[dict[str, Any]], int, int]:
    """The probe table, the chosen size (the same on every rank) and the training samples per
    process."""
    p = _Probe(cfg, env)
    per_process = len(p.splits.train) // env.world_size
    sizes = candidates(cfg, len(p.splits.train), env.world_size)
    cuda = env.device.type == "cuda"
    budget = _cuda_budget(env.device, cfg) if cuda else _cpu_budget(cfg)
    rows: list[dict[str, Any]] = []
    try:
        for size in sizes:
            status, seconds, peak = "ok", 0.0, 0
            try:
                seconds, peak = _measure(p, size, cuda)
                if peak > budget:
                    status = "over_budget"
            except torch.cuda.OutOfMemoryError:
                status = "oom"
                p.optimizer.zero_grad(set_to_none=True)
            if cuda:
                gc.collect()
                torch.cuda.empty_cache()  # free what the failed or measured step held
            # One all-reduce per size, and no other collective in the probe: every rank knows
            # whether any rank failed before deciding to go on.
            failed = float(status != "ok")
            flags = torch.tensor([failed, seconds], dtype=torch.float64, device=env.device)
            failed, seconds = env.all_reduce_sum(flags).tolist()  # HOST SYNC (probe)
            seconds /= env.world_size
            ok = failed == 0
            if not ok and status == "ok":
                status = "failed_on_another_rank"
            rows.append(_row(size, status, peak, budget, seconds if ok else None))
            if env.is_main:
                log.info("batch size probe: %s", rows[-1])
            if not ok or (not cuda and _saturated(rows)):
                break
    finally:
        del p
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    fitting = [r for r in rows if r["status"] == "ok"]
    if not fitting:
        raise UserError(
            f"loader.batch_size=auto: even a batch of {sizes[0]} does not fit under "
            f"trainer.memory_fraction={cfg.trainer.memory_fraction} ({rows[0]['status']}, "
            f"table in the log). Raise trainer.memory_fraction, make the model smaller, or "
            "switch on activation_checkpointing.mode=full."
        )
    if cuda:
        return rows, fitting[-1]["batch_size"], per_process
    best = max(r["samples_per_s"] for r in fitting)
    fast = [r["batch_size"] for r in fitting if r["samples_per_s"] >= NEAR_BEST * best]
    return rows, min(fast), per_process


def _row(size: int, status: str, peak: int, budget: float, seconds: float | None) -> dict:
    """One row of the probe table (`seconds`: None when the size failed on some rank)."""
    return {
        "batch_size": size,
        "status": status,
        "peak_mib": round(peak / 2**20, 1),
        "budget_mib": round(budget / 2**20, 1),
        "step_s": round(seconds, 5) if seconds is not None else None,
        "samples_per_s": round(size / seconds, 1) if seconds else None,
    }


def _measure(p: _Probe, size: int, cuda: bool) -> tuple[float, int]:
    """Median seconds of a training step at `size`, and the step's peak memory in bytes."""
    batch = p.batch(size)
    if cuda:
        torch.cuda.synchronize(p.device)
        torch.cuda.reset_peak_memory_stats(p.device)
    else:
        _reset_peak_rss()
    times = []
    for i in range(WARMUP_STEPS + TIMED_STEPS):
        start = time.perf_counter()
        p.step(batch)
        if cuda:
            torch.cuda.synchronize(p.device)
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_reserved(p.device) if cuda else _peak_rss()
    return statistics.median(times), peak


def _saturated(rows: list[dict[str, Any]]) -> bool:
    """CPU: the last PATIENCE sizes were no faster than the best before them."""
    speeds = [r["samples_per_s"] or 0.0 for r in rows]
    if len(speeds) <= PATIENCE:
        return False
    return max(speeds[-PATIENCE:]) <= max(speeds[:-PATIENCE])


def _cuda_budget(device: torch.device, cfg: DictConfig) -> int:
    total = torch.cuda.get_device_properties(device).total_memory
    return int(cfg.trainer.memory_fraction * total)


def _cpu_budget(cfg: DictConfig) -> int:
    """memory_fraction of what this process may use: its RSS plus its share (one of the
    node's processes) of the memory available now."""
    status, meminfo = _proc_kib("/proc/self/status"), _proc_kib("/proc/meminfo")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    usable = status.get("VmRSS", 0) + meminfo.get("MemAvailable", 0) // max(local, 1)
    return int(cfg.trainer.memory_fraction * usable * 1024)


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the peak is the process's lifetime peak: conservative


def _peak_rss() -> int:
    return _proc_kib("/proc/self/status").get("VmHWM", 0) * 1024


def _proc_kib(path: str) -> dict[str, int]:
    """The `Key: <n> kB` lines of a /proc file, in KiB ({} where there is no /proc)."""
    values: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    values[key] = int(parts[0])
    except OSError:
        pass
    return values


def _write_table(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
