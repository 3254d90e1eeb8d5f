"""Always-on speed metrics: what a step costs and where its time goes, at no extra host sync.

At each logging step (metrics.jsonl, TensorBoard, the progress line) and in summary.json:

- `train/samples_per_s`: training samples per second, all processes; `train/tokens_per_s` too
  for a task whose samples are token rows (Task.tokens_in: a language model).
- `train/step_s`: wall seconds per optimizer step over the logging interval.
- `train/data_wait_share`: the share of that time the loop spent waiting for its next batch
  (timed on the host around the loader's `next()`; the loop adds it up in `loop.data_wait_s`).
- `data/remote_images_per_s`, `data/remote_busy_share`, `data/resubmitted` (loader=ray): the
  Ray pool's images made per second, the share of its workers' time spent making them, and
  the batches sent again after a worker died (the loader's `metrics()`).
- summary.json's `sample_shape`: what one sample is, the shape of one training input as the
  model sees it (e.g. `[3, 16, 112, 112]`: a clip of 16 frames), so samples/s reads as images/s,
  clips/s or rows/s without the report knowing the data set.
- summary.json's `train_cpu_s_per_sample`: the training process's own CPU seconds per sample
  over the steady intervals (`time.process_time`, all its threads, not its loader workers).
- `train/peak_mem_mb`: the CUDA caching allocator's peak (a host-side counter, no sync), or on
  the CPU the process's resident-set high-water mark (getrusage; it includes the data set and
  the Python runtime, so compare runs with the same data).
- `train/tflops`: achieved model FLOP/s (all processes) = samples/s x FLOPs per sample, the
  latter counted once at build time by `torch.utils.flop_counter` on the real model (a forward
  of two real samples, without grad, in eval mode so no state changes) and tripled for
  forward + backward, the usual convention behind MFU (PaLM, torchtitan).
- `train/mfu`: achieved / (peak FLOP/s per device x devices), on GPUs whose peak is known
  (PEAK_FLOPS: dense bf16/fp16 tensor-core peaks) or with `trainer.peak_flops` set.

Validation time is left out of the intervals; checkpoint saves are not (they are the run's cost).
The first logging interval holds the warm-up (torch.compile, cuDNN autotuning, the allocator
growing): the summary's steady figures (`samples_per_s`, `tokens_per_s`, `step_s`, `tflops`,
`mfu`) leave it
out and report it as `warmup_s`. The times are read at logging steps, which already wait for the
device, so on CUDA they are exact over an interval though not per step.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from accel_train.data.batch import count_samples
from accel_train.techniques import LAYOUT, PARALLEL, BuildContext, Technique

log = logging.getLogger("accel_train")

# The share of training time spent waiting for data above which the run's end says so.
WAIT_HINT = 0.2

# Dense bf16/fp16 tensor-core peak FLOP/s per device, by a substring of the CUDA device name
# (vendor data sheets; the first match wins, so the specific names come first).
PEAK_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
    "T4": 65e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
}


def device_peak_flops(device: torch.device, override: float) -> float | None:
    """Peak FLOP/s of one device: `trainer.peak_flops` if set (> 0), else the table's entry for
    this GPU, else None (no MFU: CPUs and unknown GPUs)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 2**10  # bytes / KiB


def training_flops_per_sample(module: nn.Module, sample: Any, forward=None) -> float:
    """3 x the forward FLOPs of one sample (backward ~ 2 x forward), counted on the real model.
    `forward(module, sample)`: the call as the task makes it (default: module(sample))."""
    was_training = module.training
    module.eval()  # no BatchNorm statistics updated, no dropout draws from the RNG
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            forward(module, sample) if forward is not None else module(sample)
    finally:
        module.train(was_training)
    return 3.0 * counter.get_total_flops() / count_samples(sample)


class SpeedMetrics(Technique):
    name = "speed"
    # Counts FLOPs on the module as it will train (after pruning/QAT, activation checkpointing
    # and channels_last), before DDP/FSDP shard it and compile hides its ops.
    order = (LAYOUT + PARALLEL) // 2

    def __init__(self, peak_flops: float = 0.0):
        self.peak_flops_override = peak_flops
        self.flops_per_sample: float | None = None
        self.sample_shape: list[int] | None = None
        self.peak: float | None = None
        # (time, step, wait, samples, tokens, process CPU time) at the interval's start
        self._last: tuple[float, int, float, float, float, float] | None = None
        self._first_log = True
        self._paused_at = self._paused_cpu = 0.0
        self.warmup_s = 0.0
        self.steady_s = self.steady_samples = self.steady_tokens = 0.0
        self.steady_steps = 0
        self.steady_wait_s = 0.0
        self.steady_cpu_s = 0.0  # this process's CPU seconds (not its loader workers')

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        if isinstance(ctx.sample, torch.Tensor) and ctx.sample.dim() > 1:  # (2, ...): two inputs
            self.sample_shape = list(ctx.sample.shape[1:])
        try:
            if ctx.task is not None and ctx.batch is not None:  # the batch as the task calls it
                self.flops_per_sample = training_flops_per_sample(
                    model, ctx.batch, ctx.task.forward
                )
            else:
                self.flops_per_sample = training_flops_per_sample(model, ctx.sample)
        except Exception as err:  # a model the counter cannot trace: no FLOPs, still trains
            log.info("speed metrics: FLOPs not counted (%s: %s)", type(err).__name__, err)
        self.peak = device_peak_flops(ctx.env.device, self.peak_flops_override)
        return model

    def on_fit_start(self, loop: Any) -> None:
        self._last = self._now(loop)

    @staticmethod
    def _now(loop: Any) -> tuple[float, int, float, float, float, float]:
        now = time.perf_counter()
        return (
            now,
            loop.step,
            loop.data_wait_s,
            loop.samples_seen,
            loop.tokens_seen,
            time.process_time(),
        )

    def on_validation_start(self, loop: Any) -> None:
        self._paused_at, self._paused_cpu = time.perf_counter(), time.process_time()

    def on_validation_end(self, loop: Any, metrics: dict[str, float]) -> None:
        # Validation inside a logging interval is not training time: shift the interval's start.
        if self._last is not None:
            then, *rest, cpu = self._last
            paused_cpu = time.process_time() - self._paused_cpu
            self._last = (then + time.perf_counter() - self._paused_at, *rest, cpu + paused_cpu)

    def on_log(self, loop: Any, metrics: dict[str, float]) -> None:
        then, step, wait, samples, tokens, cpu = self._last
        self._last = self._now(loop)
        now = self._last[0]
        seconds, steps = now - then, loop.step - step
        if seconds <= 0 or steps <= 0:
            return
        samples_per_s = (loop.samples_seen - samples) / seconds
        metrics["train/samples_per_s"] = samples_per_s
        if loop.tokens_seen:
            metrics["train/tokens_per_s"] = (loop.tokens_seen - tokens) / seconds
        metrics["train/step_s"] = seconds / steps
        metrics["train/data_wait_share"] = (loop.data_wait_s - wait) / seconds
        metrics["train/peak_mem_mb"] = peak_memory_mb(loop.env.device)
        remote = getattr(loop.train_loader, "metrics", None)  # loader=ray: its pool's figures
        if remote is not None:
            metrics.update(remote())
        if self.flops_per_sample:
            achieved = samples_per_s * self.flops_per_sample
            metrics["train/tflops"] = achieved / 1e12
            if self.peak:
                metrics["train/mfu"] = achieved / (self.peak * loop.env.world_size)
        if self._first_log:  # warm-up: compile, autotuning, allocator growth
            self._first_log = False
            self.warmup_s = seconds
            return
        self.steady_s += seconds
        self.steady_steps += steps
        self.steady_samples += loop.samples_seen - samples
        self.steady_tokens += loop.tokens_seen - tokens
        self.steady_wait_s += loop.data_wait_s - wait
        self.steady_cpu_s += self._last[5] - cpu

    def on_fit_end(self, loop: Any) -> None:
        """One line when the loop waited on its data for more than WAIT_HINT of its time."""
        if self.steady_s <= 0 or not loop.env.is_main:
            return
        share = self.steady_wait_s / self.steady_s
        if share <= WAIT_HINT:
            return
        if getattr(loop.train_loader, "metrics", None) is not None:  # already a remote pool
            fix = (
                "more Ray data workers (loader.num_workers, or loader.cpus_per_worker on "
                "bigger nodes) would feed it faster"
            )
        else:
            fix = (
                "`loader=ray` (decoding and augmentation on a Ray cluster's CPUs) or more "
                "loader.num_workers would feed it faster"
            )
        log.info(
            "the loop waited for its data %.0f%% of its time: the input pipeline, not the "
            'model, set the speed; %s (docs/data.md, "When one node\'s CPUs are not enough")',
            100 * share,
            fix,
        )

    def summary(self, loop: Any) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "peak_mem_mb": peak_memory_mb(loop.env.device),
            "flops_per_sample": self.flops_per_sample,
            "sample_shape": self.sample_shape,
            "warmup_s": self.warmup_s,
        }
        if self.steady_s > 0:
            samples_per_s = self.steady_samples / self.steady_s
            fields |= {
                "samples_per_s": samples_per_s,
                "step_s": self.steady_s / self.steady_steps,
                "data_wait_share": self.steady_wait_s / self.steady_s,
                # The training process's own CPU per sample (its loader workers' not counted):
                # with loader=ray, what receiving a batch costs the trainer.
                "train_cpu_s_per_sample": self.steady_cpu_s / max(self.steady_samples, 1),
            }
            if self.steady_tokens:
                fields["tokens_per_s"] = self.steady_tokens / self.steady_s
            if self.flops_per_sample:
                achieved = samples_per_s * self.flops_per_sample
                fields["tflops"] = achieved / 1e12
                if self.peak:
                    fields["mfu"] = achieved / (self.peak * loop.env.world_size)
        return fields
