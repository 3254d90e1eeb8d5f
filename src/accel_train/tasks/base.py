"""What a task is: the piece that turns a batch into the model call, a loss and its metrics.

The loop calls a task through this interface only and never learns which task it runs:

    batch = task.prepare(batch, train=True, epoch=e, index=b)   # the device transform
    out = task.step(model, batch)      # under autocast: a mean loss, or (loss_sum, n_items)
    task.evaluate(model, batch, valid, autocast)                # validation / test
    task.train_metrics / task.eval_metrics                      # named sums on the device

A step that returns ``(loss_sum, n_items)`` lets the loop divide once by the items of the
whole accumulated and all-reduced batch (the "normaliser": token losses with padding, uneven
micro-batches), instead of averaging micro-batch means.

What the config checks need to know about a task is plain data on its class (read without
building anything): the validation metrics it logs (`metric_modes`), whether it can score
each sample alone (`per_sample_loss`, for selective backprop), whether its model outputs class
logits (`class_logits`, for distillation and export's agreement check), whether its data are
(input, class index) pairs (`labelled_data`), whether it reads the `loss` group
(`uses_loss_group`), whether it runs under the pipeline schedule (`pipeline`), and whether it
trains on the soft targets of mixed batches (`soft_targets`: mixup, cutmix, random erasing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from accel_train.config.task_facts import TaskFacts
from accel_train.data.batch import cast_floats, count_samples, take
from accel_train.tasks.predictions import Predictions

StepOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor | int]


class Running:
    """Named sums on the device, each with its count: a host int (samples, known from shapes)
    plus a device count (items a step counted itself, e.g. valid tokens).

    `add` is an in-place add on the device (no host read); the values are packed into the
    loop's one all-reduce at logging and validation steps and read there."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.names: list[str] = []
        self.sums: dict[str, torch.Tensor] = {}
        self.device_counts: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def declare(self, name: str, device: torch.device) -> None:
        """Make the sum now (a rank that scores only padding still packs it)."""
        if name not in self.sums:
            self.sums[name] = torch.zeros((), dtype=self.dtype, device=device)
            self.device_counts[name] = torch.zeros((), dtype=self.dtype, device=device)
            self.counts[name] = 0
            self.names.append(name)

    def add(self, name: str, total: torch.Tensor, count: int | torch.Tensor) -> None:
        """Add `total` (a device scalar: the metric summed over `count` samples or items)."""
        s = self.sums.get(name)
        if s is None:
            s = self.sums[name] = torch.zeros((), dtype=self.dtype, device=total.device)
            self.device_counts[name] = torch.zeros((), dtype=self.dtype, device=total.device)
            self.counts[name] = 0
            self.names.append(name)
        s.add_(total)
        if isinstance(count, torch.Tensor):
            self.device_counts[name].add_(count)
        else:
            self.counts[name] += count

    def pack(self) -> tuple[list[torch.Tensor], list[int]]:
        """(the sums then the device counts, as 0-d device tensors; the host counts), in
        `names` order."""
        device = [self.sums[n] for n in self.names] + [self.device_counts[n] for n in self.names]
        return device, [self.counts[n] for n in self.names]

    def read(self, device: list[float], host: list[float]) -> dict[str, float]:
        """The means from the reduced values (host floats); then start again from zero."""
        k = len(self.names)
        sums, device_counts = device[:k], device[k:]
        out = {}
        for name, s, dc, hc in zip(self.names, sums, device_counts, host, strict=True):
            if hc + dc:
                out[name] = s / (hc + dc)
        self.reset()
        return out

    def reset(self) -> None:
        for name in self.names:
            self.sums[name].zero_()
            self.device_counts[name].zero_()
            self.counts[name] = 0


@dataclass
class TaskContext:
    """What `Task.setup` may look at: the config, the data's shape, the device transform and
    two real training samples (already on the device) with the model they go through."""

    cfg: DictConfig
    device: torch.device
    data_args: dict  # Splits.data_args: in_channels, image_size, num_classes (0: none), ...
    transform: Any  # accel_train.data.transform.BatchTransform, or None
    model: nn.Module
    batch: Any  # two training samples, as the loader gives them, on the device
    augment: bool = False  # prepare the sample as a training batch (a device augment's size)
    val_samples: int = 0  # how many samples one validation scores (0: not a training run)
    warn: bool = False  # this process logs the run's warnings (one copy: the main process)
    splits: Any = None  # the run's Splits (a task that reads whole splits before training)

    @property
    def num_classes(self) -> int:
        return int(self.data_args.get("num_classes", 0))

    def prepared(self, task: Task) -> Any:
        """The sample batch as the model will see it."""
        return task.prepare(self.batch, train=self.augment)


class Task(TaskFacts):
    """Base class. Subclasses override `step` (and usually `evaluate`). The plain data the
    config checks read (`metric_modes`, `per_sample_loss`, ...) is declared on
    accel_train.config.task_facts.TaskFacts, which a built-in task's facts class extends and the
    task class inherits (so the checks read it without importing torch)."""

    def __init__(self) -> None:
        self.train_metrics = Running(torch.float32)  # logged as train/<name>
        self.eval_metrics = Running(torch.float64)  # logged as val/<name>, test/<name>
        # The parameters' dtype: precision=bf16_true casts float inputs to it in prepare().
        self.param_dtype = torch.float32

    # ---- build time ----------------------------------------------------------------------

    def setup(self, ctx: TaskContext) -> None:
        """Build what the task needs (losses) and check the model's output contract on two real
        samples (`ctx.prepared(self)`), before training: a UserError naming the key. Also
        declares the metrics validation logs, so every rank packs the same sums."""
        for name in ("loss", *self.metric_modes(ctx.cfg.task)):  # the loss first, as logged
            self.eval_metrics.declare(name, ctx.device)
        param = next(ctx.model.parameters(), None)
        self.param_dtype = param.dtype if param is not None else torch.float32

    # ---- the step ------------------------------------------------------------------------

    def prepare(self, batch: Any, *, train: bool, epoch: int = 0, index: int = 0) -> Any:
        """The batch as the model sees it (the device transform). By default as it came, its
        float tensors cast to the parameters' dtype when that is not fp32 (bf16_true)."""
        if self.param_dtype == torch.float32:
            return batch
        return cast_floats(batch, self.param_dtype)

    def inputs(self, batch: Any) -> Any:
        """What the model is called with (an export's example input, a teacher's input)."""
        return batch

    def forward(self, model: nn.Module, batch: Any) -> Any:
        """The model's forward as this task calls it, nothing recorded (FLOP counting)."""
        return model(self.inputs(batch))

    def tokens_in(self, batch: Any) -> int:
        """The tokens a prepared batch trains on, from its shapes (no host sync); 0 for a task
        whose samples are not token rows. A language model's throughput is read in tokens/s."""
        return 0

    def step(self, model: nn.Module, batch: Any) -> StepOutput:
        """One training micro-batch under autocast: the mean loss, or (loss_sum, n_items)."""
        raise NotImplementedError

    def derived(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics computed from the reduced means (e.g. perplexity from the mean loss): read
        after the one host sync of a validation or test pass."""
        return metrics

    def validation_text(
        self, model: nn.Module, autocast: Callable[[], AbstractContextManager]
    ) -> list[str]:
        """Lines the loop shows after each validation (a language model's samples). Every rank
        calls it (a sharded or pipelined model's forward is collective); rank 0 prints."""
        return []

    def shown(self, metrics: dict[str, float]) -> dict[str, float]:
        """The training metrics a logging step's console line shows (metrics.jsonl and the
        loggers get every one): all of a classifier's few, a subset of GRPO's many."""
        return metrics

    def tables(self) -> list[tuple[str, list[str], list[list[Any]]]]:
        """Tables of text the loop logs at each logging step to every logger that takes text,
        as (name, columns, rows) (a task's sampled completions); the loop adds the step."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """What a task carries from step to step that a resume needs (tensors allowed): kept in
        every checkpoint, given back to `load_state_dict` on resume. Most tasks: nothing."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what `state_dict` gave (a checkpoint without it: an empty mapping)."""

    def checkpoint_data(self) -> dict[str, Any]:
        """Plain data (JSON types only) every checkpoint keeps for the tools that read it
        without the training data: a language model's tokenizer, for accel-sample."""
        return {}

    def resume_conflict(self, saved: dict[str, Any]) -> str | None:
        """Why a checkpoint whose checkpoint_data() was `saved` does not fit this run's data
        (None: it does); the resume refuses it unless `resume_new_tokenizer=true`."""
        return None

    def keep_predictions(self) -> Predictions | None:
        """Start keeping each evaluated item's predicted class (tasks/predictions.py), for
        accel-eval's predictions file and per-class accuracy: the record `evaluate` fills, or
        None for a task that predicts no classes (the default)."""
        return None

    def eval_output(self, model: nn.Module, batch: Any) -> Any:
        """What `evaluate` scores by default: the step's own output (no grad)."""
        return self.step(model, batch)

    def evaluate(
        self,
        model: nn.Module,
        batch: Any,
        valid: int,
        autocast: Callable[[], AbstractContextManager],
    ) -> None:
        """One evaluation batch (no grad): add into `eval_metrics`. The first `valid` samples
        are real, the rest padding (every rank runs the same batches). By default: the
        training step's loss (and metrics) on the real samples."""
        n = valid
        if valid < count_samples(batch):
            batch = take(batch, max(valid, 1))  # (all padding: still run, collectives need it)
        with autocast():
            out = self.eval_output(model, batch)
        if n == 0:
            return
        loss, items, metrics = split_output(out)
        if items is None:
            self.eval_metrics.add("loss", loss.detach().double() * n, n)
        else:  # a summed loss over `items`: the mean is over the items, not the samples
            self.eval_metrics.add("loss", loss.detach().to(self.eval_metrics.dtype), items)
        for key, value in metrics.items():
            self.eval_metrics.add(key, value.detach().double() * n, n)


@contextlib.contextmanager
def evaluating(model: nn.Module):
    """The model in eval mode under no_grad (a setup check's forward, a reference pass), its
    train/eval mode restored after."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def split_output(out: Any) -> tuple[torch.Tensor, Any, Mapping[str, torch.Tensor]]:
    """A step's return value -> (loss, n_items or None, metrics)."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return out[0], None, out[1]
    if isinstance(out, tuple) and len(out) == 2:
        return out[0], out[1], {}
    if isinstance(out, tuple) and len(out) == 3:  # (loss_sum, n_items, metrics)
        return out[0], out[1], out[2]
    return out, None, {}
