"""The training loop: as lean as a hand-written one, with exact resume.

Hot-path rules: the loss stays on the device (summed into a device tensor), and the host waits
for the device only on logging, validation and checkpoint steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from accel_train import checkpoint as ckpt_io
from accel_train.config import UserError, flatten, to_container
from accel_train.data import IGNORE_INDEX, BatchTransform, build_loader, dataset_nbytes, load_split
from accel_train.distributed import DistEnv, process_group, wrap_model
from accel_train.loggers import MetricsLogger, Progress
from accel_train.models import build_model, count_parameters
from accel_train.optim import build_optimizer, build_scheduler, scaled_lr
from accel_train.precision import Precision, resolve_precision

log = logging.getLogger("accel_train")


def run_training(cfg: DictConfig) -> dict[str, Any]:
    """Train with a resolved config, in this process (as one rank when inside torchrun)."""
    if cfg.trainer.tune_malloc:
        keep_freed_host_memory()
    with process_group(cfg.trainer.device, cfg.strategy.backend) as env:
        if env.distributed:
            agree_on_config(cfg, env)
        return Trainer(cfg, env).fit()


def agree_on_config(cfg: DictConfig, env: DistEnv) -> None:
    """Every rank must train the same config (nodes compose their own); name the first
    difference. Then global rank 0 writes the run's config.yaml."""
    import torch.distributed as dist

    from accel_train.launch import write_run_config

    mine = flatten(to_container(cfg))
    mine.pop("launcher.node_rank", None)  # the one key that differs between nodes by design
    gathered: list[dict | None] = [None] * env.world_size
    dist.all_gather_object(gathered, mine)
    for rank, theirs in enumerate(gathered):
        if theirs != gathered[0]:
            key = next(
                k
                for k in sorted(set(theirs) | set(gathered[0]))
                if theirs.get(k) != gathered[0].get(k)
            )
            raise UserError(
                f"the nodes disagree on the config: {key}={gathered[0].get(key)!r} on rank 0 but "
                f"{theirs.get(key)!r} on rank {rank}. Start every node with the same overrides "
                "(only launcher.node_rank may differ)."
            )
    if env.is_main:
        write_run_config(cfg, Path(cfg.paths.output_dir))


def keep_freed_host_memory() -> None:
    """Stop glibc from handing each step's freed activation and gradient buffers back to the OS
    (mmap above 32 MiB only, never trim the heap): otherwise every step page-faults them in
    again, ~20-25% of a CPU epoch here (BENCHMARKS.md). No-op where libc is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 2**31 - 1)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest


@torch.no_grad()
def evaluate(model, loader, transform, precision: Precision, env: DistEnv) -> tuple[float, float]:
    """Mean loss and accuracy over the whole split, each example counted once across ranks."""
    model.eval()
    stats = torch.zeros(3, dtype=torch.float64, device=env.device)  # loss sum, correct, count
    for images, labels in loader.epoch(0):
        with precision.autocast():
            logits = model(transform(images, train=False))
        logits = logits.float()
        stats[0] += F.cross_entropy(logits, labels, reduction="sum", ignore_index=IGNORE_INDEX)
        stats[1] += (logits.argmax(1) == labels).sum()
        stats[2] += (labels != IGNORE_INDEX).sum()
    loss_sum, correct, count = env.all_reduce_sum(stats).tolist()
    return loss_sum / max(count, 1), correct / max(count, 1)


class Trainer:
    def __init__(self, cfg: DictConfig, env: DistEnv):
        self.cfg, self.env = cfg, env
        t, lc = cfg.trainer, cfg.loader
        self.run_dir = Path(cfg.paths.output_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        seed_everything(t.seed, t.deterministic)
        self.precision = resolve_precision(cfg.precision.name, env.device, cfg.precision.tf32)

        train_set = load_split(cfg.dataset, cfg.paths.data_dir, train=True)
        val_set = load_split(cfg.dataset, cfg.paths.data_dir, train=False)
        if lc.name == "device":
            _check_fits_on_device(dataset_nbytes(train_set) + dataset_nbytes(val_set), env.device)
        common = dict(device=env.device, seed=t.seed, rank=env.rank, world=env.world_size)
        self.train_loader = build_loader(
            train_set, lc, train=True, limit=t.limit_train_batches, **common
        )
        self.val_loader = build_loader(
            val_set, lc, train=False, limit=t.limit_val_batches, **common
        )
        if len(self.train_loader) == 0:
            raise UserError(
                f"loader.batch_size={lc.batch_size} x {env.world_size} process(es) is larger than "
                f"the {len(train_set)} training samples with loader.drop_last=true: no batch to "
                "train on. Lower loader.batch_size or set `loader.drop_last=false`."
            )
        self.transform = BatchTransform(
            cfg.dataset, env.device, self.precision.param_dtype, t.channels_last, t.seed, env.rank
        )

        memory_format = torch.channels_last if t.channels_last else torch.preserve_format
        self.module = build_model(cfg.model, cfg.dataset).to(
            env.device, dtype=self.precision.param_dtype, memory_format=memory_format
        )
        self.model = wrap_model(self.module, cfg.strategy, env)
        # FSDP checkpoints are sharded (torch.distributed.checkpoint); others are one file.
        self.sharded = cfg.strategy.name == "fsdp" and env.distributed
        self.ckpt_suffix = ".dcp" if self.sharded else ".pt"
        self.accum = t.accumulate_grad_batches
        self.global_batch = lc.batch_size * self.accum * env.world_size
        self.steps_per_epoch = math.ceil(self.train_loader.order.num_batches / self.accum)
        self.total_steps = t.max_epochs * self.steps_per_epoch
        if t.max_steps > 0:
            self.total_steps = (
                min(self.total_steps, t.max_steps) if t.max_epochs > 0 else t.max_steps
            )
        self.max_epochs = math.ceil(self.total_steps / self.steps_per_epoch)

        lr = scaled_lr(cfg.optimizer, self.global_batch)
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optimizer, lr, env.device)
        self.scheduler = build_scheduler(
            self.optimizer, cfg.scheduler, self.total_steps, lr / cfg.optimizer.lr
        )
        self.scaler = self.precision.grad_scaler()
        # DDP's forward may broadcast buffers, a collective: validate on the bare module.
        self.eval_model = self.module if cfg.strategy.name == "ddp" else self.model
        if t.compile:
            self.model = torch.compile(self.model)
            self.eval_model = (
                torch.compile(self.eval_model) if cfg.strategy.name == "ddp" else self.model
            )

        self.epoch = self.step = self.batch_in_epoch = 0
        self.best_val_acc = -1.0
        self.last_val: tuple[float, float] | None = None
        self.stop_requested = False  # set by SIGUSR1 on this rank
        self.stopping = False  # agreed by all ranks: checkpoint and leave at this step
        self.metrics = MetricsLogger(self.run_dir, cfg.logger.name, enabled=env.is_main)
        self.progress = Progress(t.progress, enabled=env.is_main)

    # ---- the loop ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        with _on_signal(signal.SIGUSR1, self._request_stop):
            return self._fit()

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True
        log.warning("rank %d: SIGUSR1 received, checkpointing at the next step", self.env.rank)

    def _should_stop(self, synced: bool) -> bool:
        """One process checks its flag every step; several agree at logging steps (where they
        already synchronise), so no step pays for a collective of its own."""
        if not self.env.distributed:
            self.stopping = self.stop_requested
        return self.stopping and (synced or not self.env.distributed)

    def _stop_for_requeue(self) -> dict[str, Any]:
        """Preempted (or near the time limit): save, then requeue the SLURM job (rank 0)."""
        self._save("last")
        ckpt = self.ckpt_dir / f"last{self.ckpt_suffix}"
        log.warning("stopped at epoch %d step %d; checkpoint %s", self.epoch, self.step, ckpt)
        self.progress.close()
        self.metrics.log({"event": "preempted"}, self.step, self.epoch)
        self.metrics.close()
        if self.env.is_main:
            from accel_train.slurm import requeue_or_stop

            requeue_or_stop(self.cfg.launcher.max_requeues, ckpt)
        return {"status": "preempted", "steps": self.step, "epochs": self.epoch}

    def _fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        resumed_from = self._maybe_resume()
        self._announce(resumed_from)
        train_time, samples = 0.0, 0
        with self._profiler() as prof:
            while self.epoch < self.max_epochs and self.step < self.total_steps:
                t0 = time.perf_counter()
                epoch_samples = self._train_epoch(prof)
                _sync(self.env.device)
                epoch_s = time.perf_counter() - t0
                train_time, samples = train_time + epoch_s, samples + epoch_samples
                self.metrics.log(
                    {
                        "train/epoch_s": epoch_s,
                        "train/epoch_samples_per_s": epoch_samples / epoch_s,
                    },
                    self.step,
                    self.epoch,
                )
                if self.stopping:
                    return self._stop_for_requeue()
                epoch_done = self.batch_in_epoch >= self.train_loader.order.num_batches
                if epoch_done:
                    self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                finished = self.epoch >= self.max_epochs or self.step >= self.total_steps
                if finished or (
                    epoch_done and self.epoch % self.cfg.trainer.val_every_n_epochs == 0
                ):
                    self._validate()
                self._save("last")
        summary = self._summary(samples / max(train_time, 1e-9), time.perf_counter() - start)
        self.progress.close()
        self.metrics.close()
        return summary

    def _train_epoch(self, prof) -> int:
        """Train from self.batch_in_epoch to the end of the epoch (or max_steps)."""
        self.model.train()
        order = self.train_loader.order
        start_batch = self.batch_in_epoch
        self.progress.start_epoch(self.epoch, order.num_batches, start_batch)
        loss_sum = torch.zeros((), device=self.env.device)  # sample-weighted, for logging
        loss_samples, samples, logged_samples, tick = 0, 0, 0, time.perf_counter()
        log_every, ckpt_every = (
            self.cfg.trainer.log_every_n_steps,
            self.cfg.trainer.ckpt_every_n_steps,
        )
        for b, (images, labels) in enumerate(
            self.train_loader.epoch(self.epoch, start_batch), start_batch
        ):
            x = self.transform(images, train=True, epoch=self.epoch, batch=b)
            boundary = (b + 1) % self.accum == 0 or b + 1 == order.num_batches
            n = labels.shape[0]
            # Weight by the samples in this step's accumulation window, so that a short last
            # batch or a last window of fewer micro-batches gives the mean over its samples,
            # the same gradient as one batch holding them all.
            window = order.window_len(b, self.accum)
            with _gradient_sync(self.model, boundary):
                with self.precision.autocast():
                    loss = F.cross_entropy(self.model(x), labels)
                self.scaler.scale(loss * (n / window)).backward()
            loss_sum.add_(loss.detach(), alpha=n)
            loss_samples += n
            samples += n
            self.progress.advance()
            if not boundary:
                continue
            self._optimizer_step()
            self.batch_in_epoch = b + 1
            if prof is not None:
                prof.step()
            if self.step % log_every == 0:
                now = time.perf_counter()
                self._log_train(loss_sum, loss_samples, samples - logged_samples, now - tick)
                loss_sum.zero_()
                loss_samples, logged_samples, tick = 0, samples, now
            if ckpt_every and self.step % ckpt_every == 0:
                self._save("last")
            if self.step >= self.total_steps or self._should_stop(self.step % log_every == 0):
                break
        return samples * self.env.world_size

    def _optimizer_step(self) -> None:
        clip = self.cfg.trainer.gradient_clip_val
        if clip > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1

    def _log_train(self, loss_sum, loss_samples, samples, seconds) -> None:
        counts = torch.tensor([loss_samples, self.stop_requested], dtype=torch.float32)
        stats = torch.cat([loss_sum.float().view(1), counts.to(loss_sum.device)])
        # The step's one host sync; it also tells every rank whether any rank was told to stop.
        loss_total, count, stop_votes = self.env.all_reduce_sum(stats).tolist()
        self.stopping = stop_votes > 0
        metrics = {
            "train/loss": loss_total / max(count, 1),
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/samples_per_s": samples * self.env.world_size / max(seconds, 1e-9),
        }
        self.metrics.log(metrics, self.step, self.epoch)
        self.progress.show(
            {
                "loss": metrics["train/loss"],
                "lr": metrics["train/lr"],
                "samples/s": round(metrics["train/samples_per_s"]),
            },
            self.step,
            self.epoch,
        )

    def _validate(self) -> None:
        loss, acc = evaluate(
            self.eval_model, self.val_loader, self.transform, self.precision, self.env
        )
        self.last_val = (loss, acc)
        self.metrics.log({"val/loss": loss, "val/acc": acc}, self.step, self.epoch)
        self.progress.message(
            f"epoch {self.epoch} step {self.step}  val/loss={loss:.4f}  val/acc={acc:.4f}"
        )
        if acc > self.best_val_acc:
            self.best_val_acc = acc
            self._save("best")

    # ---- checkpoints -----------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """Everything but the sharded model/optimizer (those go through DCP under FSDP)."""
        full = (
            {}
            if self.sharded
            else {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
            }
        )
        return {
            "format": ckpt_io.FORMAT_VERSION,
            **full,
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "progress": {
                "epoch": self.epoch,
                "step": self.step,
                "batch_in_epoch": self.batch_in_epoch,
                "best_val_acc": self.best_val_acc,
                "last_val": list(self.last_val) if self.last_val else None,
            },
            "rng": ckpt_io.rng_state(),
            "config": to_container(self.cfg),
        }

    def _save(self, name: str) -> None:
        path = self.ckpt_dir / f"{name}{self.ckpt_suffix}"
        if self.sharded:
            ckpt_io.save_sharded(self.module, self.optimizer, self._state(), path, self.env.is_main)
            return
        if self.env.is_main:
            ckpt_io.atomic_save(self._state(), path)
        self.env.barrier()

    def _maybe_resume(self) -> str | None:
        resume = self.cfg.resume
        if resume is None:
            return None
        path = self.ckpt_dir / f"last{self.ckpt_suffix}" if resume == "auto" else Path(resume)
        if resume == "auto" and not path.exists():
            return None  # nothing to resume from: a fresh start, not an error
        if path.is_dir():  # a sharded checkpoint, loadable at any world size
            state = ckpt_io.load_sharded_meta(path, key="resume")
            ckpt_io.load_sharded(self.module, self.optimizer, path)
        else:
            state = ckpt_io.load_checkpoint(path, key="resume")
            if self.sharded:
                raise UserError(
                    f"resume={path}: a single-file checkpoint cannot be loaded into strategy=fsdp; "
                    "resume it with strategy=ddp or single."
                )
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        p = state["progress"]
        self.epoch, self.step, self.batch_in_epoch = p["epoch"], p["step"], p["batch_in_epoch"]
        self.best_val_acc = p["best_val_acc"]
        self.last_val = tuple(p["last_val"]) if p["last_val"] else None
        ckpt_io.set_rng_state(state["rng"])
        self.metrics.log({"event": "resume", "from": str(path)}, self.step, self.epoch)
        return str(path)

    # ---- reporting -------------------------------------------------------------------

    def _announce(self, resumed_from: str | None) -> None:
        if not self.env.is_main:
            return
        lc = self.cfg.loader
        log.info(
            "model %s (%s parameters) on %s; precision %s",
            self.cfg.model.name,
            f"{count_parameters(self.module):,}",
            self.env.device,
            self.precision.describe(),
        )
        log.info(
            "batch: %d per device x %d accumulation x %d process(es) = %d global; "
            "%d optimizer steps (%d per epoch, %d epochs); loader=%s",
            lc.batch_size,
            self.accum,
            self.env.world_size,
            self.global_batch,
            self.total_steps,
            self.steps_per_epoch,
            self.max_epochs,
            lc.name,
        )
        if resumed_from:
            log.info("resumed from %s at epoch %d, step %d", resumed_from, self.epoch, self.step)

    def _summary(self, samples_per_s: float, wall_s: float) -> dict[str, Any]:
        summary = {
            "best_val_acc": self.best_val_acc,
            "final_val_acc": self.last_val[1] if self.last_val else None,
            "final_val_loss": self.last_val[0] if self.last_val else None,
            "epochs": self.epoch,
            "steps": self.step,
            "train_samples_per_s": samples_per_s,
            "wall_s": wall_s,
            "precision": self.precision.describe(),
            "device": str(self.env.device),
            "world_size": self.env.world_size,
            "global_batch": self.global_batch,
            "run_dir": str(self.run_dir),
        }
        if self.env.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            log.info(
                "done: %d steps, %d epochs, best val/acc %.4f, %.0f samples/s, %.1f s",
                self.step,
                self.epoch,
                self.best_val_acc,
                samples_per_s,
                wall_s,
            )
        return summary

    @contextlib.contextmanager
    def _profiler(self):
        t = self.cfg.trainer
        if not t.profile:
            yield None
            return
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU]
        if self.env.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        trace_dir = self.run_dir / "profile"
        with profile(
            activities=activities,
            schedule=schedule(wait=1, warmup=1, active=t.profile_steps, repeat=1),
            on_trace_ready=tensorboard_trace_handler(
                str(trace_dir), worker_name=f"rank{self.env.rank}"
            ),
            record_shapes=True,
        ) as prof:
            yield prof
        if self.env.is_main:
            log.info(
                "profiler trace written to %s (open in TensorBoard or ui.perfetto.dev)", trace_dir
            )


def _gradient_sync(model, enabled: bool):
    """Skip the gradient all-reduce (DDP) / reduce-scatter (FSDP) on accumulation micro-steps."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if no_sync is not None and not enabled else contextlib.nullcontext()


@contextlib.contextmanager
def _on_signal(signum: int, handler):
    """Install a signal handler for the duration (only the main thread may)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_fits_on_device(nbytes: int, device: torch.device) -> None:
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > free // 2:
        raise UserError(
            f"loader=device: the data set needs {nbytes / 2**20:.0f} MiB on {device} but only "
            f"{free / 2**20:.0f} MiB are free (half is kept for the model). Use `loader=torch`."
        )
