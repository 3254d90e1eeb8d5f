"""trainer.on_nonfinite: a non-finite training loss, gradient or weight stops the run (`stop`,
the default) or skips the optimizer step (`skip_step`), without a host sync between logging
steps.

How it stays off the hot path:

- Every training micro-batch's loss is added, on the device, into a small per-step buffer (the
  loop's `on_loss` hook, whatever the task: one in-place add). Nothing is read between checks.
- The buffer is read at the checks, where the host waits for the device anyway: the logging
  step (``on_log``), validation (``on_validation_start``), and every checkpoint save
  (``on_save``, and as a last guard ``state_dict()``, which the save calls before writing). A
  check also looks at the weights (one reduction), which catches a non-finite gradient whose
  loss was still finite. Several processes agree on the outcome with one small all-reduce.
- `stop`: the first check that sees a non-finite value raises a UserError (exit 2) naming the
  step, the last finite loss and the likely fixes. It runs before the save it guards, so
  ``last.pt`` keeps the last finite state and ``best.pt`` is never non-finite.
- `skip_step`: before each optimizer step (an optimizer step pre-hook) the gradient norm and the
  step's loss are checked on the device. A fused optimizer (``optimizer.fused=true``; the default
  on CUDA) gets the flag as ``found_inf``, the contract torch's GradScaler uses with fused
  Adam/AdamW/SGD: the kernel skips the update on the device, no sync. A non-fused optimizer
  (foreach, the CPU default) can only be skipped from the host: the flag is read every step,
  the same per-step sync that ``torch.amp.GradScaler`` pays in ``_maybe_opt_step``
  (``found_inf.item()``). That is the documented price of `skip_step` without fused kernels.
  With several processes the flag is all-reduced on the device every step, so all ranks skip
  the same steps. The learning-rate schedule still advances on a skipped step (as with
  GradScaler). Skipped steps are counted in ``train/skipped_steps`` at logging steps and in
  ``summary.json``.

With fp16 and a GradScaler, overflowing gradients are the scaler's business (it skips the step
and lowers the scale); only a non-finite loss counts here.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from accel_train.errors import UserError
from accel_train.techniques import Technique

log = logging.getLogger("accel_train")

MODES = ("stop", "skip_step")
# Steps buffered between checks (checks run at least every trainer.log_every_n_steps steps; a
# longer stretch shares the last slot, which still detects but no longer pinpoints the step).
MAX_WINDOW = 4096
LOSS, GRAD_NORM, SKIPPED = 0, 1, 2  # rows of the device buffer


@dataclass
class _Event:
    """The first non-finite value seen."""

    what: str  # "loss", "gradient norm", "weights"
    value: float
    first: int  # first step it may have happened at
    last: int  # the step at which it was found
    epoch: int


@dataclass
class _Window:
    """Host-side bookkeeping for the steps since the last read of the device buffer."""

    base: int  # the optimizer step before the window's first step
    samples: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)


class NonFinite(Technique):
    name = "nonfinite"

    def __init__(self, mode: str = "stop"):
        if mode not in MODES:
            raise UserError(f"trainer.on_nonfinite={mode!r} is not one of {', '.join(MODES)}.")
        self.mode = mode
        self.skipped = 0  # optimizer steps skipped so far (checkpointed)
        self.loop: Any = None
        self.event: _Event | None = None
        self.last_finite: tuple[float, int] | None = None  # (loss, step)
        self.saved_step: int | None = None  # step of the last checkpoint this run wrote
        self.checked_step = -1  # everything up to this step was checked finite
        self.skips_since_log: list[int] = []
        self.finite_loss = [0.0, 0]  # (sample-weighted sum, samples) since the last log
        self._handles: list[Any] = []
        self._set_found_inf = False

    # ---- hooks -------------------------------------------------------------------------

    def on_fit_start(self, loop: Any) -> None:
        self.loop = loop
        size = min(loop.log_every, MAX_WINDOW) + 1  # (the loop's trainer.log_every_n_steps)
        self.size = size
        # float32 like the loss (autocast computes losses in fp32): no dtype conversion per add.
        self.buf = torch.zeros(3, size, dtype=torch.float32, device=loop.env.device)
        self.loss_slots = list(self.buf[LOSS])  # views made once: indexing costs more than the add
        self.window = _Window(loop.step, [0] * size, [loop.epoch] * size)
        self.checked_step = loop.step
        if loop.step > 0:  # resumed: the checkpoint it came from is the last saved state
            self.saved_step = loop.step
        if self.mode == "skip_step":
            opt = loop.optimizer
            self.fused = bool(getattr(opt, "_step_supports_amp_scaling", False)) and all(
                group.get("fused") for group in opt.param_groups
            )
            self.check_grads = not loop.scaler.is_enabled()
            self._handles.append(opt.register_step_pre_hook(self._before_step))
            self._handles.append(opt.register_step_post_hook(self._after_step))
            if not self.fused and loop.env.is_main:
                log.info(
                    "trainer.on_nonfinite=skip_step with a non-fused optimizer: the skip "
                    "decision is read on the host every step (as torch's GradScaler does); "
                    "`optimizer.fused=true` skips on the device without that sync"
                )

    def on_log(self, loop: Any, metrics: dict[str, float]) -> None:
        # Host reads here: the logging step already waits for the device.
        totals = self._check(loop, "the logging step", with_loss=True)
        if self.mode != "skip_step":
            return
        loss_sum, samples = totals
        if not math.isfinite(metrics.get("train/loss", 0.0)):
            # The loop's mean includes the non-finite losses of skipped steps: show the rest.
            metrics["train/loss"] = loss_sum / samples if samples else None
        metrics["train/skipped_steps"] = self.skipped
        if self.skips_since_log and loop.env.is_main:
            steps = self.skips_since_log
            where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
            log.warning(
                "trainer.on_nonfinite=skip_step: skipped %d optimizer step(s) with a non-finite "
                "loss or gradient norm at %s (%d so far)",
                len(steps),
                where,
                self.skipped,
            )
        self.skips_since_log = []

    def on_validation_start(self, loop: Any) -> None:
        self._check(loop, "validation")  # do not score (and maybe save as best) broken weights

    def on_save(self, loop: Any, name: str = "last") -> None:
        """Fired by the loop before it writes a checkpoint (every rank): nothing non-finite is
        saved."""
        self._check(loop, f"the save of {name}")
        self.saved_step = loop.step

    def on_fit_end(self, loop: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def summary(self, loop: Any) -> dict[str, Any]:
        """The mode and the skipped steps."""
        if self.loop is not None:
            self._drain()  # HOST SYNC: end of the run
        return {"on_nonfinite": self.mode, "skipped_steps": self.skipped}

    def state_dict(self) -> dict[str, Any]:
        loop = self.loop
        if loop is not None:
            if self.checked_step != loop.step:
                # The last guard before a checkpoint is written (the save calls state_dict()):
                # on this rank only, as the save may call it on rank 0 alone.
                self._check(loop, "the checkpoint save", collective=False)
            self.saved_step = loop.step
        return {"skipped_steps": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = int(state.get("skipped_steps", 0))

    # ---- the device side (no host reads) -----------------------------------------------

    def _slot(self) -> int:
        return min(self.loop.step - self.window.base, self.size - 1)

    def on_loss(self, loop: Any, loss: torch.Tensor, n: int) -> None:
        """Every training micro-batch's loss (a mean over n samples): add it into this step's
        slot on the device."""
        if self.loop is None:
            return
        j = self._slot()
        self.loss_slots[j].add_(loss, alpha=n)
        self.window.samples[j] += n
        self.window.epochs[j] = self.loop.epoch

    def _before_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """skip_step: decide on the device whether this step's update is applied."""
        j = self._slot()
        loss = self.buf[LOSS, j]
        bad = ~torch.isfinite(loss)
        if self.check_grads:
            grads = [
                _local(p.grad)
                for group in optimizer.param_groups
                for p in group["params"]
                if p.grad is not None
            ]
            if grads:
                norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
                self.buf[GRAD_NORM, j].copy_(norm)
                bad = bad | ~torch.isfinite(norm)
        found = bad.to(torch.float32)
        if self.loop.env.distributed:  # every rank skips the same steps (device all-reduce)
            found = (self.loop.env.all_reduce_sum(found) > 0).to(torch.float32)
        self.buf[SKIPPED, j].copy_(found)
        if self.fused:
            # GradScaler's contract with fused optimizers: found_inf=1 skips the update.
            previous = getattr(optimizer, "found_inf", None)
            if previous is not None:  # set by an enabled GradScaler: keep its verdict too
                optimizer.found_inf = torch.maximum(previous, found.to(previous.device))
            else:
                optimizer.found_inf = found
                optimizer.grad_scale = None
                self._set_found_inf = True
            return
        # HOST SYNC (skip_step, non-fused optimizer only): the documented per-step read, as in
        # torch.amp.GradScaler._maybe_opt_step. No gradient: the optimizer leaves every
        # parameter (and its state) as it is.
        if found.item():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def _after_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if self._set_found_inf:
            del optimizer.found_inf
            del optimizer.grad_scale
            self._set_found_inf = False

    # ---- the checks (host reads, at sync points only) ----------------------------------

    def _drain(self) -> None:
        """Read and clear the device buffer: the steps since the last read."""
        loop, window = self.loop, self.window
        k = min(loop.step - window.base, self.size)
        if k <= 0:
            return
        # HOST SYNC: only called at logging, validation and checkpoint steps.
        rows = self.buf[:, :k].tolist()
        self.buf[:, :k].zero_()
        for j in range(k):
            step = window.base + j + 1 if j < self.size - 1 else loop.step
            n, loss_sum = window.samples[j], rows[LOSS][j]
            loss = loss_sum / n if n else None
            if rows[SKIPPED][j]:
                self.skipped += 1
                self.skips_since_log.append(step)
            if loss is not None and math.isfinite(loss):
                self.finite_loss[0] += loss_sum
                self.finite_loss[1] += n
                if self.event is None:
                    self.last_finite = (loss, step)
            elif self.event is None and loss is not None:
                self.event = _Event("loss", loss, step, loop.step, window.epochs[j])
            if self.event is None and not math.isfinite(rows[GRAD_NORM][j]):
                self.event = _Event(
                    "gradient norm", rows[GRAD_NORM][j], step, loop.step, window.epochs[j]
                )
        self.window = _Window(loop.step, [0] * self.size, [loop.epoch] * self.size)

    def _check(
        self, loop: Any, where: str, *, with_loss: bool = False, collective: bool = True
    ) -> tuple[float, int]:
        """Drain the buffer, look at the weights, agree across ranks; in `stop` mode raise on
        the first non-finite value. Returns the finite training loss (sum, samples) since the
        last logging step, summed over the ranks, when `with_loss`."""
        self._drain()
        if self.mode == "skip_step":
            self.event = None  # skipped, not fatal; only non-finite weights are
        weights_ok = self.event is not None or _finite_weights(loop.module)
        if not weights_ok:
            self.event = _Event("weights", math.nan, self.checked_step + 1, loop.step, loop.epoch)
        totals = (0.0, 0)
        if with_loss:
            totals, self.finite_loss = (self.finite_loss[0], self.finite_loss[1]), [0.0, 0]
        bad = self.event is not None
        if collective and loop.env.distributed:
            vec = torch.tensor([float(bad), *totals], dtype=torch.float64, device=loop.env.device)
            bad_ranks, loss_sum, samples = loop.env.all_reduce_sum(vec).tolist()
            bad, totals = bad_ranks > 0, (loss_sum, int(samples))
        if bad:
            if self.event is None:  # another rank saw it
                self.event = _Event(
                    "remote", math.nan, self.checked_step + 1, loop.step, loop.epoch
                )
            event_log = {"event": "nonfinite", "what": self.event.what, "step": self.event.first}
            if self.last_finite is not None:
                event_log["last_finite_loss"] = self.last_finite[0]
            loop.metrics.log(event_log, loop.step, loop.epoch)
            raise UserError(self._message(loop, where))
        self.checked_step = loop.step
        return totals

    def _message(self, loop: Any, where: str) -> str:
        e, cfg = self.event, loop.cfg
        if e.what == "weights":
            what = (
                f"the weights became non-finite between optimizer steps {e.first} and {e.last} "
                "(a gradient was not finite while the training loss was)"
            )
        elif e.what == "remote":
            what = (
                "the training loss or weights became non-finite on another rank between "
                f"optimizer steps {e.first} and {e.last}"
            )
        else:
            value = "nan" if math.isnan(e.value) else f"{e.value}"
            what = (
                f"the training {e.what} was {value} at optimizer step {e.first} (epoch "
                f"{e.epoch}; steps before it were finite)"
            )
        what += f", found at {where} (step {e.last})"
        last = (
            f"The last finite training loss was {self.last_finite[0]:.4g} (step "
            f"{self.last_finite[1]})."
            if self.last_finite
            else "No finite training loss was seen before it."
        )
        suffix = loop.checkpointer.suffix
        if self.saved_step is not None:
            saved = (
                f"Nothing non-finite was saved: checkpoints/last{suffix} holds the last finite "
                f"state that was written (step {self.saved_step}) and best{suffix} only finite "
                f"weights; resume from it after the fix with `resume={loop.ckpt_dir}/last{suffix}`."
            )
        else:
            saved = "No checkpoint was written before it."
        fixes = []
        lr_key = "scheduler.max_lr" if cfg.scheduler.name == "onecycle" else "optimizer.lr"
        lr_value = cfg.scheduler.max_lr if lr_key == "scheduler.max_lr" else cfg.optimizer.lr
        fixes.append(f"lower {lr_key} (now {lr_value:g})")
        fp16 = cfg.precision.name == "fp16" or (
            cfg.precision.name == "amp" and loop.env.device.type == "cuda"
        )
        if fp16:
            fixes.append("train in `precision=bf16` or `precision=fp32` instead of fp16")
        elif cfg.precision.name == "bf16_true":
            fixes.append("keep fp32 weights with `precision=bf16` (or `precision=fp32`)")
        clip = cfg.trainer.gradient_clip_val
        fixes.append(
            f"lower trainer.gradient_clip_val (now {clip:g})"
            if clip > 0
            else "clip gradients with `trainer.gradient_clip_val=1.0`"
        )
        if cfg.loss.get("name") == "custom":
            fixes.append(f"check the loss (loss._target_={cfg.loss._target_})")
        if self.mode == "stop":
            fixes.append("skip such steps with `trainer.on_nonfinite=skip_step`")
        return (
            f"training stopped: {what}. {last} {saved} Likely fixes: "
            + ", ".join(fixes[:-1])
            + f", or {fixes[-1]}."
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds of a DTensor (FSDP2), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _finite_weights(module: nn.Module) -> bool:
    """HOST SYNC (checks only): every trained parameter and floating buffer finite, in one
    read. Frozen parameters (model.freeze, a LoRA base, perhaps stored as NF4) are not changed
    by training, so they are not read."""
    tensors = [_local(p.detach()) for p in module.parameters() if p.requires_grad]
    tensors += [_local(b) for b in module.buffers() if b.is_floating_point()]
    if not tensors:
        return True
    norms = torch._foreach_norm(tensors)
    return bool(torch.isfinite(torch.stack(norms)).all())
