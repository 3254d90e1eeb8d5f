"""The training loop: as lean as a hand-written one, with exact resume. In pseudocode:

    resume from a checkpoint (resume=auto|path)
    for epoch:
        for micro-batch (any structure: tensors, tuples, dicts):
            batch = task.prepare(batch)                  # the device transform
            loss = task.step(model, batch)               # under autocast: the task's step
            scale(loss * share of the step's samples).backward()
              (or, for a step returning (loss_sum, n_items): backward of the sum, and the
              gradient divided once by the items of the whole accumulated, all-reduced batch)
            on an accumulation boundary: clip, optimizer step, schedule step, techniques' hooks
            every log_every_n_steps: ONE host sync (loss, the task's metrics, stop votes)
            every val_check_interval: validate; then every ckpt_every_n_steps: save last (so
              last.pt records the validation of its own step)
        validate (every val_every_n_epochs and at the end); checkpoint.monitor ranks the
            weights: keep the top k files and best (train/checkpointing.py); save last
    test the best checkpoint on the test split (trainer.test_after_fit), write summary.json

Hot-path rule: the loss stays on the device (summed into a device tensor), and the host waits
for the device only on logging, validation and checkpoint steps. Each such place says so.
A stop signal (train/signals.py) asks for a stop: the ranks agree at the next logging step, save
last, and return status "preempted"; the launch side decides what happens next (e.g. a SLURM
requeue).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from accel_train.config.facts import batches_note, validation_metrics
from accel_train.console import Progress, print_summary, shown_numbers, start_curves_plot
from accel_train.data.batch import count_samples
from accel_train.errors import DataSourceLost
from accel_train.loggers import MetricsLogger
from accel_train.parallel import DistEnv, process_group
from accel_train.strategies.tensor_parallel import local
from accel_train.tasks import split_output
from accel_train.techniques import Technique
from accel_train.train.agreement import agree_on_config
from accel_train.train.auto_batch import resolve_batch_size
from accel_train.train.build import Components, build_components
from accel_train.train.checkpointer import Checkpointer
from accel_train.train.checkpointing import Checkpointing, known_metrics
from accel_train.train.evaluate import score
from accel_train.train.resume import Resumed, checkpoint_state, resume
from accel_train.train.run_report import announce, test_pass, write_summary
from accel_train.train.signals import StopRequest
from accel_train.train.stopping import save_after_lost_source, stop_run

log = logging.getLogger("accel_train")


def run_training(cfg: DictConfig) -> dict[str, Any]:
    """Train with a resolved config, in this process (as one rank when inside torchrun)."""
    with process_group(cfg.trainer.device, cfg.strategy.backend) as env:
        if env.distributed:
            agree_on_config(cfg, env)
        resolve_batch_size(cfg, env)  # loader.batch_size=auto: probed or taken from the resume
        loop = Loop(cfg, env, build_components(cfg, env))
        try:
            return loop.fit()
        finally:
            # Before process_group tears the group down: the DDP/FSDP module, the optimizer and
            # the loaders must be gone, or gloo's threads are still held when the interpreter
            # finalises and the rank aborts after its work is done (issue 22, section 0).
            loop.release()


class Loop:
    def __init__(self, cfg: DictConfig, env: DistEnv, parts: Components):
        """The loop's whole state, declared in one place.

        Long because it declares every attribute the loop, its techniques and its checkpoints
        read, each with its comment: split, the state would be spread over several methods."""
        self.cfg, self.env, self.parts = cfg, env, parts
        # Shortcuts for what the step touches (and what techniques read).
        self.model, self.module, self.eval_model = parts.model, parts.module, parts.eval_model
        self.optimizer, self.scheduler, self.scaler = parts.optimizer, parts.scheduler, parts.scaler
        self.task, self.precision = parts.task, parts.precision
        self.train_loader, self.val_loader = parts.train_loader, parts.val_loader
        self.techniques = parts.techniques
        # The training loss: the task's step, wrapped by techniques that change what is
        # computed (selective backprop, distillation): compute_loss(batch) -> the step's output.
        # The first technique in the list wraps outermost.
        self.compute_loss = self._base_loss
        for technique in reversed(self.techniques):
            self.compute_loss = technique.wrap_loss(self, self.compute_loss)
        # Techniques that watch every micro-batch's loss (nonfinite).
        self._loss_watchers = [
            t for t in self.techniques if type(t).on_loss is not Technique.on_loss
        ]
        self.run_dir = Path(cfg.paths.output_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.accum = cfg.trainer.accumulate_grad_batches
        # The parallelism (accel_train/strategies/): a pipeline's schedule runs each
        # micro-batch itself (_forward_backward); the processes of one pipeline or one TP group
        # share a batch, so the data-parallel width is smaller than the world.
        self.strategy = parts.strategy
        self.owns_step = self.strategy.owns_forward_backward(env)
        _, self.data_world = self.strategy.data_coords(env)
        # Tensor parallelism: the processes of a TP group hold the same batch (and loss).
        self.tp = self.strategy.spread
        # Context parallelism: the processes of a CP group hold parts of the same sequences.
        self.cp = self.strategy.sequence_split
        self.log_every = log_interval(cfg.trainer.log_every_n_steps, parts.steps_per_epoch)
        # The normaliser: a step that returns (loss_sum, n_items) has its items counted on the
        # device; at the accumulation boundary the gradient is divided once by the items of the
        # whole accumulated, all-reduced batch.
        self.items = torch.zeros((), device=env.device)
        self.normalise = False  # this accumulation window's steps returned (loss_sum, n_items)
        # One micro-batch a step in one data-parallel process: the window's items are this
        # step's own, so dividing the summed loss before backward gives the same gradient
        # without the normaliser's extra pass over every gradient (BENCHMARKS.md section 16).
        self.divide_loss = self.accum == 1 and self.data_world == 1 and self.cp == 1
        # Which files are kept, named and ranked (checkpoint.*): train/checkpointing.py.
        self.checkpoints = Checkpointing(
            cfg.checkpoint,
            self.ckpt_dir,
            self.strategy.checkpoint_suffix(env.distributed),
            known_metrics(cfg, self.techniques),
            env.is_main,
        )

        self.epoch = self.step = self.batch_in_epoch = 0
        # Read at logging steps: the lr the logged step used and its gradient norm (a device
        # tensor, the one clipping computes), kept by _optimizer_step on those steps only.
        self.step_lr: Any = cfg.optimizer.get("lr", 0.0)
        self.grad_norm: torch.Tensor | None = None
        # Host-side counters the speed metrics read at logging steps (techniques/speed.py).
        self.data_wait_s = 0.0  # seconds spent waiting for the next training batch
        self.samples_seen = 0  # training samples, all processes
        self.tokens_seen = 0  # training tokens, all processes (a task of token rows: tokens_in)
        # The best value of every validation metric with a declared mode (summary.json's
        # best_val_<name>: best_val_acc for a classifier, best_val_loss for any task).
        self.val_modes = {k[4:]: v for k, v in validation_metrics(cfg).items()}
        self.best_val: dict[str, float] = {}
        self.last_val: dict[str, float] | None = None  # the last validation's metrics
        self.validated_step: int | None = None  # the step of the last validation
        self.saved_last: tuple[int, int] | None = None  # (step, epoch) last.pt was saved at
        # Set by a signal on this rank; one process acts on it at the next step, several agree
        # at the next logging step.
        self.stop = StopRequest(env.rank, every_step=not env.distributed)
        self.stopping = False  # agreed by all ranks: checkpoint and leave at this step
        self.finish_reason: str | None = None  # set by finish(): training is over, early
        self.metrics = MetricsLogger(
            self.run_dir, cfg.logger, enabled=env.is_main, run_config=cfg,
            tables=self.task.table_names,
        )  # fmt: skip
        # Writes, waits for and loads checkpoints (sync, async, sharded): train/checkpointer.py.
        self.checkpointer = Checkpointer(
            cfg, env, self.strategy, self.ckpt_dir, self.metrics, lambda: checkpoint_state(self)
        )
        self.progress = Progress(cfg.trainer.progress, enabled=env.is_main)

    def release(self) -> None:
        """Drop everything this loop holds (model, optimizer, loaders, techniques): the
        techniques' loss wrappers close over the loop, so without this the DDP module would
        live in a reference cycle until a garbage collection long after the process group is
        destroyed."""
        checkpointer = self.__dict__.get("checkpointer")
        if checkpointer is not None:  # a save still in flight completes (the run failed)
            checkpointer.close()
        self.__dict__.clear()

    def _apply(self, resumed: Resumed) -> None:
        """Continue where the checkpoint left off (train/resume.py loaded the components)."""
        self.epoch, self.step = resumed.epoch, resumed.step
        # The length counted from the checkpoint on (train/resume.py, resumed_length): the steps
        # done at another data-parallel width are not counted again at this one.
        self.parts.total_steps, self.parts.max_epochs = resumed.total_steps, resumed.max_epochs
        self.batch_in_epoch = resumed.batch_in_epoch
        self.best_val, self.last_val = resumed.best_val, resumed.last_val
        self.validated_step = resumed.validated_step
        if resumed.finish_reason is not None:
            self.finish_reason = resumed.finish_reason
        if resumed.scheduler is not None:  # rebuilt for a new length or config
            self.scheduler = self.parts.scheduler = resumed.scheduler

    def _fire(self, hook: str, *args) -> None:
        for technique in self.techniques:
            getattr(technique, hook)(self, *args)

    # ---- the loop ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        with self.stop.installed():
            start = time.perf_counter()
            resumed = resume(self)
            if resumed is not None and resumed.summary is not None:
                self.progress.close()
                return resumed.summary  # the run had already finished: its summary stands
            if resumed is not None:
                self._apply(resumed)
            announce(self, resumed.path if resumed else None)
            # The bar reads the loop's host counters itself (no call per step).
            position = lambda: (self.step, self.epoch, self.batch_in_epoch)  # noqa: E731
            self.progress.start_run(
                self.parts.total_steps, self.parts.max_epochs, self.step, position
            )
            self._fire("on_fit_start")
            try:
                if resumed is not None:
                    self._validate_if_owed()
                train_time, samples = self._train()
            finally:
                self._fire("on_fit_end")
                self.train_loader.close()  # the workers go now, also when stopped by a signal
                self.val_loader.close()
            self.checkpointer.wait()  # async_save: the last checkpoint complete before what follows
            if self.stopping or self._asked_to_stop_after_training():
                return stop_run(self)
            if self.finish_reason and self.env.is_main:
                log.info("finished early: %s", self.finish_reason)
            # curves.png is drawn in a thread while the test pass runs (console.py says why).
            plotted = (
                start_curves_plot(self.run_dir)
                if self.cfg.trainer.plot_curves and self.env.is_main
                else None
            )
            test = test_pass(self) if self.cfg.trainer.test_after_fit else None
            self.progress.close()  # before the `done:` line, which would land on the bar
            summary = write_summary(self, samples / max(train_time, 1e-9), start, test)
            if plotted is not None:
                plotted()
        self.metrics.close()
        if self.env.is_main and self.cfg.trainer.progress != "none":
            # the end of a run on the console
            print_summary(self.progress.console(), summary, self.ckpt_dir, self.checkpoints.monitor)
        return summary

    def _train(self) -> tuple[float, int]:
        train_time, samples = 0.0, 0
        p = self.parts
        while self.epoch < p.max_epochs and self.step < p.total_steps and not self.finish_reason:
            t0 = time.perf_counter()
            epoch_samples = self._train_epoch()
            _sync(self.env.device)  # epoch timing: wait for the epoch's last kernels
            epoch_s = time.perf_counter() - t0
            train_time, samples = train_time + epoch_s, samples + epoch_samples
            self.metrics.log(
                {"train/epoch_s": epoch_s, "train/epoch_samples_per_s": epoch_samples / epoch_s},
                self.step,
                self.epoch,
            )
            if self.stopping:
                return train_time, samples
            epoch_done = self.batch_in_epoch >= self.train_loader.order.num_batches
            if epoch_done:
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
            finished = self.epoch >= p.max_epochs or self.step >= p.total_steps
            due = finished or (epoch_done and self.epoch % self.cfg.trainer.val_every_n_epochs == 0)
            if due and not self.finish_reason:  # (finished at a validation: it was this step's)
                self._validate(final=finished)
            if self.cfg.checkpoint.save_last or self._checkpoint_step():
                self.save_last()
        return train_time, samples

    def _train_epoch(self) -> int:
        """Train from self.batch_in_epoch to the end of the epoch (or max_steps)."""
        self.model.train()
        order = self.train_loader.order
        start_batch = self.batch_in_epoch
        self.progress.start_epoch(self.epoch, order.num_batches, start_batch)
        loss_sum = torch.zeros((), device=self.env.device)  # sample-weighted, for logging
        loss_items = torch.zeros((), device=self.env.device)  # items of summed losses
        loss_samples, samples = 0, 0
        log_every = self.log_every
        batches = self._timed(self.train_loader.epoch(self.epoch, start_batch))
        for b, batch in enumerate(batches, start_batch):
            batch = self.task.prepare(batch, train=True, epoch=self.epoch, index=b)
            boundary = (b + 1) % self.accum == 0 or b + 1 == order.num_batches
            n = count_samples(batch)  # a shape: no host sync
            # Weight by the samples in this step's accumulation window, so that a short last
            # batch or a last window of fewer micro-batches gives the mean over its samples,
            # the same gradient as one batch holding them all.
            window = order.window_len(b, self.accum)
            with _gradient_sync(self.model, boundary):
                loss, items = self._forward_backward(batch, n / window)
            if items is None:
                loss_sum.add_(loss, alpha=n)
                loss_samples += n
            else:  # a summed loss: train/loss is the mean over the items
                loss_sum.add_(loss)
                loss_items.add_(items)
            samples += n
            self.samples_seen += n * self.data_world
            self.tokens_seen += self.task.tokens_in(batch) * self.data_world
            if not boundary:
                continue
            self._optimizer_step()
            self.batch_in_epoch = b + 1
            self._fire("on_train_step_end")
            if self.step % log_every == 0:
                self._log_train(loss_sum, loss_items, loss_samples)
                loss_sum.zero_()
                loss_items.zero_()
                loss_samples = 0
            # Validate first, then save: last.pt at a step that validates holds that
            # validation (its metrics row, checkpoint.monitor's best, the top k), so a resume
            # from it neither skips the validation nor ranks best.pt without it (issue 47).
            if self._validates_mid_epoch(b, order.num_batches):
                self._validate()
                self.model.train()
            ends = b + 1 == order.num_batches or self.step >= self.parts.total_steps
            if self._checkpoint_step() and not ends:
                self.save_last()  # (the epoch's last step: _train saves after validating)
            if self.step >= self.parts.total_steps or self._should_stop(self.step % log_every == 0):
                break
            if self.finish_reason:
                break
        return samples * self.data_world

    def _checkpoint_step(self) -> bool:
        """trainer.ckpt_every_n_steps: last.pt is saved at this step."""
        every = self.cfg.trainer.ckpt_every_n_steps
        return bool(every) and self.step % every == 0

    def save_last(self) -> None:
        """last.pt, once per (step, epoch): a step that ends the training early (a target
        reached mid-epoch) is not written twice."""
        if self.saved_last != (self.step, self.epoch):
            self.save("last")

    def _validate_if_owed(self) -> None:
        """Resumed mid-epoch at a step whose validation was due but that the checkpoint does not
        record (a checkpoint written before its validation, as before issue 47): validate now,
        as the uninterrupted run did at this step, before its best.pt and metrics go on."""
        b = self.batch_in_epoch
        if b == 0 or self.validated_step == self.step or self.finish_reason:
            return
        if not self._validates_mid_epoch(b - 1, self.train_loader.order.num_batches):
            return
        if self.env.is_main:
            log.info(
                "the checkpoint at step %d holds no record of its validation: validating now",
                self.step,
            )
        self._validate()

    def _validates_mid_epoch(self, b: int, num_batches: int) -> bool:
        """trainer.val_check_interval: validate inside an epoch (a validating one) every
        fraction of it, or every N optimizer steps; the epoch's end validates anyway."""
        interval = self.cfg.trainer.val_check_interval
        if b + 1 >= num_batches or self.step >= self.parts.total_steps or interval == 1.0:
            return False
        if (self.epoch + 1) % self.cfg.trainer.val_every_n_epochs:
            return False
        if isinstance(interval, float):
            every = max(1, round(interval * self.parts.steps_per_epoch))
            return -(-(b + 1) // self.accum) % every == 0  # optimizer steps into this epoch
        return self.step % interval == 0

    def finish(self, reason: str) -> None:
        """End training after this validation, as if it were the last (early stopping, a
        target reached): last.pt, the test pass and summary.json follow as usual."""
        if self.finish_reason is None:
            self.finish_reason = reason

    def _timed(self, batches):
        """The batches, timing on the host how long each `next()` waited (no device sync)."""
        batches = iter(batches)
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            except DataSourceLost as err:
                raise DataSourceLost(save_after_lost_source(self, err)) from None
            self.data_wait_s += time.perf_counter() - start
            yield batch

    def _forward_backward(self, batch, weight: float):
        """One micro-batch: the (technique-wrapped) task step under autocast, then backward of
        its `weight`ed, scaled loss, or of its summed loss (the normaliser divides the gradient
        at the boundary). Returns (the loss, detached, on the device; its item count or None):
        no host sync."""
        if self.owns_step:  # the pipeline schedule: forward + backward of all stages
            loss = self.strategy.forward_backward(self.task, batch, weight, self.scaler)
            items = None
        else:  # (context parallelism: this process's part of the sequences, both passes)
            with self.strategy.sequence_shards(self.task, batch) as part:
                loss, items = self._step_and_backward(part, weight)
        if self._loss_watchers:
            mean = loss if items is None else loss / items
            n = count_samples(batch)
            for technique in self._loss_watchers:
                technique.on_loss(self, mean, n)
        return loss, items

    def _step_and_backward(self, batch, weight: float):
        with self.precision.autocast():
            loss, items = self.compute_loss(batch)
        if items is None:
            self.scaler.scale(loss * weight).backward()
        elif self.divide_loss:  # the mean over this step's items, on the device
            n_items = items.clamp(min=1) if isinstance(items, torch.Tensor) else max(items, 1)
            self.scaler.scale(loss / n_items).backward()
        else:
            self.scaler.scale(loss).backward()
            self.items.add_(items)
            self.normalise = True
        return loss.detach(), items

    def _base_loss(self, batch):
        """The task's step: (loss, None) for a mean loss, (loss_sum, n_items) for a sum."""
        loss, items, _ = split_output(self.task.step(self.model, batch))
        return loss, items

    def _normalise_gradients(self) -> None:
        """The normaliser: the window's steps returned summed losses; divide the gradients once
        by the items of the whole accumulated batch over all data-parallel processes. DDP and
        FSDP average the gradients over the processes, hence the factor world / items. The
        all-reduce of the count runs on the device: no host sync."""
        # (Summed over all processes: a TP group counts its items tp times, a CP group each of
        # its items once; FSDP averages over the data-parallel ranks times the CP groups.)
        spread = self.data_world * self.tp * self.cp
        items = self.env.all_reduce_sum(self.items) if spread > 1 else self.items
        factor = self.data_world * self.cp / (items / self.tp).clamp(min=1)
        # (A sharded gradient's local part: FSDP x TP puts gradients on two meshes, which one
        # foreach op over the DTensors refuses.)
        grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)
        self.items.zero_()
        self.normalise = False

    def _optimizer_step(self) -> None:
        # async_save: the background copy of the weights complete before they change
        self.checkpointer.wait_before_weights_change()
        if self.normalise:
            self._normalise_gradients()
        self.strategy.before_optimizer_step()  # e.g. tied weights on two stages: one gradient
        clip = self.cfg.trainer.gradient_clip_val
        logged = (self.step + 1) % self.log_every == 0  # _log_train reports this step
        if clip > 0 or logged:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            # (the strategy's norm: over all stages, or over whole and sharded gradients). A
            # logging step without clipping measures it the same way: a factor of exactly 1.
            norm = self.strategy.clip_grad_norm_(self.model.parameters(), clip or math.inf)
            if logged:  # train/grad_norm, read with the logging step's sync (no sync here)
                self.grad_norm = norm
        if logged:  # train/lr: the rate this step used, before the schedule moves it on
            lr = self.optimizer.param_groups[0]["lr"]  # (a tensor lr is changed in place)
            self.step_lr = lr.clone() if isinstance(lr, torch.Tensor) else lr
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1

    def _log_train(self, loss_sum, loss_items, loss_samples) -> None:
        loss_samples = self.strategy.logged_samples(loss_samples)  # pipeline: its last stages'
        # The task's metrics ride in the same all-reduce: device sums, then host counts.
        on_device, on_host = self.task.train_metrics.pack()
        counts = torch.tensor([loss_samples, self.stop.requested, *on_host], dtype=torch.float32)
        device = loss_sum.device
        stats = torch.cat(
            [
                loss_sum.float().view(1),
                loss_items.float().view(1),
                *(t.float().view(1) for t in on_device),
                counts.to(device),
            ]
        )
        # HOST SYNC (logging step): the step's one wait for the device; the all-reduce also
        # tells every rank whether any rank was asked to stop.
        values = self.env.all_reduce_sum(stats).tolist()
        norm = _local_value(self.grad_norm)  # (the device has just synced: no wait)
        k = len(on_device)
        loss_total, items = values[0], values[1]
        count, stop_votes = values[2 + k], values[3 + k]
        task_metrics = self.task.train_metrics.read(values[2 : 2 + k], values[4 + k :])
        self.stopping = stop_votes > 0
        metrics = {
            "train/loss": loss_total / max(count + items, 1),
            **{f"train/{name}": value for name, value in task_metrics.items()},
            "train/lr": float(self.step_lr),  # the rate this step used (a tensor lr: a read)
        }
        if norm is not None and math.isfinite(norm):  # (an AMP step skipped for inf: none)
            metrics["train/grad_norm"] = norm
        self._fire("on_log", metrics)  # techniques/speed.py adds samples/s, step time, ...
        self.metrics.log(metrics, self.step, self.epoch)
        for name, columns, rows in self.task.tables():  # e.g. GRPO's sampled completions
            self.metrics.log_table(
                name, ["step", *columns], [[self.step, *r] for r in rows], self.step
            )
        shown = shown_numbers(metrics, self.task.shown(task_metrics))  # (GRPO: a few of many)
        self.progress.show(shown, self.step, self.epoch)

    def _validate(self, final: bool = False) -> None:
        # async_save: the copy complete before EMA swaps its weights in for validation
        self.checkpointer.wait_before_weights_change()
        self._fire("on_validation_start")
        # HOST SYNC (validation): score() reads the task's summed metrics once at its end.
        scored = score(self.eval_model, self.val_loader, self.task, self.precision, self.env)
        self.last_val, self.validated_step = scored, self.step
        metrics = {f"val/{name}": value for name, value in scored.items()}
        self._fire("on_validation_end", metrics)
        self.metrics.log(metrics, self.step, self.epoch)
        shown = "  ".join(f"val/{name}={value:.4f}" for name, value in scored.items())
        shown += batches_note(self.val_loader)  # " (N batches)": limit_val_batches cut it
        self.progress.message(f"{self.progress.where(self._trained_epoch(), self.step)}  {shown}")
        for line in self.task.validation_text(self.eval_model, self.precision.autocast):
            if self.env.is_main:  # (task.sample_lines: sampled text, into the log file too)
                log.info("step %d %s", self.step, line)
        self._track_best(scored)
        epoch = self._trained_epoch()
        plan = self.checkpoints.plan(metrics, epoch, self.step, self.checkpoints.due(epoch, final))
        if plan is not None:
            # rank 0, once the file is complete: best.pt, and the files out of the top k.
            kept = self.checkpoints.kept
            top = kept[0]["name"] if kept else None
            self.save(plan.name, then=lambda: self.checkpoints.commit(plan, top))
            self.env.barrier()
        # The checkpoint above holds the weights validation scored (ema's average).
        self._fire("after_validation")

    def _track_best(self, scored: dict[str, float]) -> None:
        """summary.json's best_val_<name>, whatever checkpoint.monitor watches."""
        for name, value in scored.items():
            mode = self.val_modes.get(name)
            best = self.best_val.get(name)
            if mode is None or not math.isfinite(value):
                continue
            if best is None or (value > best if mode == "max" else value < best):
                self.best_val[name] = value

    def _asked_to_stop_after_training(self) -> bool:
        """A signal during the last validation (or last.pt's save) came after the last step
        that could act on it: stop before the test pass, with last.pt already at the end (a
        `resume=auto` then only runs the test pass). A signal during the test pass lets it
        finish: it is the run's last work."""
        if not self.env.distributed:
            self.stopping = self.stop.requested
            return self.stopping
        vote = torch.tensor([float(self.stop.requested)], device=self.env.device)
        # HOST SYNC (once a run): the ranks agree, as they would have at a logging step.
        self.stopping = self.env.all_reduce_sum(vote).item() > 0
        return self.stopping

    def _should_stop(self, synced: bool) -> bool:
        """One process checks its flag every step; several agree at logging steps (where they
        already synchronise), so no step pays for a collective of its own."""
        if not self.env.distributed:
            self.stopping = self.stop.requested
        return self.stopping and (synced or not self.env.distributed)

    # ---- checkpoints ---------------------------------------------------------------------

    def save(self, name: str, then=None) -> None:
        """Write checkpoint `name` (then call `then` on rank 0, once it is complete)."""
        self._fire("on_save", name)  # before anything is written: e.g. nonfinite
        if name == "last":
            self.saved_last = (self.step, self.epoch)
        self.checkpointer.save(name, self.module, self.optimizer, self.step, self.epoch, then)

    def _trained_epoch(self) -> int:
        """The epoch the weights were last trained in (0-based, as the training lines show):
        at an epoch end self.epoch already counts the next one."""
        return self.epoch - 1 if self.batch_in_epoch == 0 and self.epoch > 0 else self.epoch


def log_interval(log_every_n_steps: int, steps_per_epoch: int) -> int:
    """trainer.log_every_n_steps, 0 = auto: 50 steps, or a quarter epoch when epochs are
    shorter, so every epoch (the first too) logs train/loss a few times."""
    if log_every_n_steps > 0:
        return log_every_n_steps
    return max(1, min(50, steps_per_epoch // 4))


def _gradient_sync(model, enabled: bool):
    """Skip the gradient all-reduce (DDP) / reduce-scatter (FSDP) on accumulation micro-steps."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if no_sync is not None and not enabled else contextlib.nullcontext()


def _local_value(norm: torch.Tensor | None) -> float | None:
    """A gradient norm as a number (a DTensor's: its replicated value)."""
    if norm is None:
        return None
    full = getattr(norm, "full_tensor", None)
    return float((full() if full is not None else norm).item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
