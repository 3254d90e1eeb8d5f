"""ema.enabled: an exponential moving average of the weights, used for validation, best.pt and
the test pass.

- The average covers the parameters and the floating-point buffers (BatchNorm's running
  statistics), so the averaged model validates with statistics of its own kind.
- Update (`on_train_step_end`, every `ema.every_n_steps` optimizer steps): one
  ``torch._foreach_lerp_`` over device tensors, ``ema += (1 - decay) * (weights - ema)``; no host
  sync. Until `ema.start_step` the average copies the weights instead.
- Warm-up (`ema.warmup=true`, the default): the n-th averaging update uses
  ``min(decay, (1 + n) / (10 + n))`` (TensorFlow's ExponentialMovingAverage with num_updates,
  diffusers' EMAModel), so early on the average follows the weights. Without it, decay 0.999
  over a 142-step MNIST run leaves an average that is mostly the initial weights: test accuracy
  60 % against 97.6 % (BENCHMARKS.md section 20). `ema.warmup=false` is timm's and
  torch.optim.swa_utils' constant decay. The decay is a host number computed from the step, so
  a resume is still exact.
- Sharded (FSDP): the average holds the local shards of the DTensor parameters and updates them
  locally, no gather per step. A checkpoint gathers it once (``full_tensor``, on every rank, as
  the sharded save calls ``state_dict()`` on every rank) into the checkpoint's meta.pt; a resume
  slices each rank's shard back out (at any world size).
- Validation swaps the average into the model (``on_validation_start``) and the training weights
  back (``after_validation``, once the loop has written best.pt), so best.pt's `model` is the
  averaged weights that were validated, and `accel-eval` and the test pass score those.
  last.pt keeps the training weights as `model` and the average here, so a resume is exact.
- Low-precision parameters (precision=bf16_true) are averaged in float32: a bf16 average would
  round away the (1 - decay) updates.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from accel_train.errors import UserError
from accel_train.techniques import Technique

# checkpoint_wrapper (activation checkpointing) nests blocks under this name; the average is
# keyed by the names without it, so resuming with activation checkpointing switched finds it.
_WRAPPED = "_checkpoint_wrapped_module."


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: in-place ops on it change the DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


class Ema(Technique):
    name = "ema"

    def __init__(
        self, decay: float, every_n_steps: int = 1, start_step: int = 0, warmup: bool = True
    ):
        self.decay, self.every, self.start, self.warmup = decay, every_n_steps, start_step, warmup
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []  # the model's parameters and float buffers
        self.average: list[torch.Tensor] = []  # same shapes (DTensors under FSDP), float32+
        self.pending: dict[str, torch.Tensor] | None = None  # loaded before on_fit_start
        self.backup: list[torch.Tensor] | None = None  # the training weights during validation

    # ---- set-up --------------------------------------------------------------------------

    def on_fit_start(self, loop: Any) -> None:
        if self.tensors:
            return
        module = loop.module  # the bare model (under FSDP2: its parameters are DTensors)
        named = list(module.named_parameters()) + [
            (n, b) for n, b in module.named_buffers() if b.is_floating_point()
        ]
        self.names = [n.replace(_WRAPPED, "") for n, _ in named]
        self.tensors = [t for _, t in named]
        with torch.no_grad():
            self.average = [
                t.detach().clone().to(torch.promote_types(t.dtype, torch.float32))
                for t in self.tensors
            ]
        if self.pending is not None:
            self._load(self.pending)
            self.pending = None

    # ---- the update (every step: device tensors only) --------------------------------------

    @torch.no_grad()
    def on_train_step_end(self, loop: Any) -> None:
        step = loop.step
        if step % self.every:
            return
        average = [_local(a) for a in self.average]
        current = [_local(t) for t in self.tensors]
        if step <= self.start:
            torch._foreach_copy_(average, current)
            return
        if current and current[0].dtype != average[0].dtype:  # bf16 parameters: average in fp32
            current = [c.to(a.dtype) for c, a in zip(current, average)]
        torch._foreach_lerp_(average, current, 1.0 - self.decay_at(step))

    def decay_at(self, step: int) -> float:
        """The decay of the update at optimizer step `step` (> start_step)."""
        if not self.warmup:
            return self.decay
        n = (step - self.start - 1) // self.every  # 0 for the first averaging update
        return min(self.decay, (1 + n) / (10 + n))

    # ---- validation with the average ------------------------------------------------------

    @torch.no_grad()
    def on_validation_start(self, loop: Any) -> None:
        current = [_local(t) for t in self.tensors]
        self.backup = [c.clone() for c in current]
        torch._foreach_copy_(current, [_local(a) for a in self.average])

    @torch.no_grad()
    def after_validation(self, loop: Any) -> None:
        if self.backup is None:
            return
        torch._foreach_copy_([_local(t) for t in self.tensors], self.backup)
        self.backup = None

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # HOST SYNC (checkpoint): a sharded average is gathered here, on every rank.
        full = [a.full_tensor() if isinstance(a, DTensor) else a for a in self.average]
        return {"decay": self.decay, "tensors": dict(zip(self.names, full))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tensors:
            self._load(state["tensors"])
        else:
            self.pending = state["tensors"]  # resume runs before on_fit_start

    @torch.no_grad()
    def _load(self, saved: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in saved]
        if missing:
            raise UserError(
                f"the checkpoint's EMA (ema.enabled) has no average for {missing[0]} (and "
                f"{len(missing) - 1} more): it was written for another model. Start a fresh run "
                "(no `resume`), or resume with `ema.enabled=false`."
            )
        for name, average in zip(self.names, self.average):
            value = saved[name].to(average.device, average.dtype)
            if isinstance(average, DTensor):  # every rank has the whole tensor: no scatter
                value = distribute_tensor(
                    value, average.device_mesh, average.placements, src_data_rank=None
                )
            _local(average).copy_(_local(value))
