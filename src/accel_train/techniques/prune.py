"""prune: magnitude pruning during training with torch.nn.utils.prune, ramped to `prune.amount`.

At build time every Linear/Conv weight except the output layer's (the last one whose outputs are
the classes: pruning it would delete classes or their evidence) gets torch's pruning
reparametrization (``prune.identity``: ``weight = weight_orig * weight_mask``, recomputed in a
forward pre-hook), before DDP wraps and compile traces the model, so the module structure never
changes during training. From ``on_train_step_end``, every ``schedule.every_n_steps`` optimizer
steps between ``schedule.start`` and ``schedule.end``, the masks are recomputed for the scheduled
sparsity (cubic or linear ramp) by torch's own pruning methods and copied into the mask buffers
in place, on the device (no host sync):

- unstructured, global: ``L1Unstructured.compute_mask`` over all weights at once, exactly what
  ``prune.global_unstructured`` does (one magnitude threshold for the whole model);
- unstructured, layer: ``L1Unstructured`` per weight (``prune.l1_unstructured``);
- structured (layer only): ``LnStructured(n=2, dim=0)`` per weight (``prune.ln_structured``):
  whole output channels / neurons. The tensors keep their shape (zeroed rows): no memory or
  speed gain unless the network is sliced afterwards, which this does not do.

Importance is the masked weight and the old mask is the default mask, so a pruned weight stays
pruned (the masks only grow) and the sparsity follows the schedule exactly.

Checkpoints: every checkpoint holds plain weights (``weight = weight_orig * weight_mask``, by a
state-dict hook), so ``accel-eval`` and any plain model load them; the masks ride in the
technique state (bool tensors, loaded with torch's weights-only unpickler like the rest). A
resume loads the weights into ``weight_orig`` (a load pre-hook) and then the exact masks. At the
end (``on_fit_end``) ``prune.remove`` makes the pruning permanent: the model is plain again.

DDP: every rank computes the same masks from the same weights; DDP is told not to broadcast the
mask buffers. FSDP is refused (config checks): the masks are full tensors, the weights shards.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import prune

from accel_train.errors import UserError
from accel_train.techniques import PREPARE, BuildContext, Technique

log = logging.getLogger("accel_train")

PRUNABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class Prune(Technique):
    name = "prune"
    order = PREPARE  # change the modules before activation checkpointing, DDP and compile

    def __init__(
        self,
        amount: float,
        method: str = "unstructured",
        scope: str = "global",
        start: float = 0.0,
        end: float = 0.8,
        ramp: str = "cubic",
        every_n_steps: int = 10,
    ):
        self.amount, self.method, self.scope = amount, method, scope
        self.start, self.end, self.ramp, self.every = start, end, ramp, every_n_steps
        self.modules: dict[str, nn.Module] = {}  # qualified name -> pruned module
        self.target = 0.0  # the sparsity the masks were last computed for
        self.final_masks: dict[str, torch.Tensor] | None = None  # after prune.remove
        self._handles: list[Any] = []

    # ---- build: the reparametrization -------------------------------------------------

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        num_classes = None
        if ctx.task is None or ctx.task.class_logits:
            with torch.no_grad():
                was_training = model.training
                model.eval()
                num_classes = model(ctx.sample).shape[1]
                model.train(was_training)
        found = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, PRUNABLE) and isinstance(getattr(m, "weight", None), nn.Parameter)
        ]
        # The output layer stays dense: a classifier's is the one of num_classes outputs; for
        # other tasks the last prunable layer.
        if found and (num_classes is None or found[-1][1].weight.shape[0] == num_classes):
            found = found[:-1]
        if not found:
            raise UserError(
                "prune.amount is set but the model has no Linear or Conv weight to prune besides "
                "its output layer. Turn pruning off (`prune.amount=0`) or use a deeper model."
            )
        for name, m in found:
            prune.identity(m, "weight")  # weight_orig + weight_mask (ones) + forward pre-hook
            self._handles.append(m.register_state_dict_post_hook(_save_plain))
            self._handles.append(m.register_load_state_dict_pre_hook(_load_plain))
            self.modules[name] = m
        if ctx.strategy.replicates_buffers:
            # Every rank computes the same masks: no need to broadcast them each forward.
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, [f"{name}.weight_mask" for name in self.modules]
            )
        return model

    # ---- the schedule (host arithmetic only) ------------------------------------------

    def on_fit_start(self, loop: Any) -> None:
        total = loop.parts.total_steps
        self.first, self.last = self._step(self.start, total), self._step(self.end, total)
        if loop.env.is_main:
            params = sum(m.weight_orig.numel() for m in self.modules.values())
            log.info(
                "prune: %s %s to %.0f%% of %d layers (%s weights), %s ramp over optimizer steps "
                "%d-%d, masks updated every %d steps%s",
                self.method,
                self.scope,
                100 * self.amount,
                len(self.modules),
                f"{params:,}",
                self.ramp,
                self.first,
                self.last,
                self.every,
                f" (the run has only {total}: it ends before the final sparsity)"
                if self.last > total
                else "",
            )

    @staticmethod
    def _step(value: float, total: int) -> int:
        return round(value * total) if value <= 1 else int(value)

    def scheduled(self, step: int) -> float:
        span = self.last - self.first
        p = 1.0 if span <= 0 else min(max((step - self.first) / span, 0.0), 1.0)
        return self.amount * (1 - (1 - p) ** 3 if self.ramp == "cubic" else p)

    def on_train_step_end(self, loop: Any) -> None:
        step = loop.step
        if step < self.first or step > self.last:
            return
        if step != self.last and (step - self.first) % self.every != 0:
            return
        target = self.scheduled(step)
        if target > self.target:
            self._update_masks(target)
            self.target = target

    @torch.no_grad()
    def _update_masks(self, sparsity: float) -> None:
        """New masks for `sparsity`, copied into the mask buffers (device ops only)."""
        modules = list(self.modules.values())
        masked = [m.weight_orig * m.weight_mask for m in modules]
        if self.method == "structured":
            method = prune.LnStructured(sparsity, n=2, dim=0)
        else:
            method = prune.L1Unstructured(sparsity)
        if self.scope == "layer":
            for m, weight in zip(modules, masked, strict=True):
                m.weight_mask.copy_(method.compute_mask(weight, m.weight_mask))
            return
        # global: as torch.nn.utils.prune.global_unstructured, on all weights flattened.
        scores = torch.cat([w.flatten() for w in masked])
        default = torch.cat([m.weight_mask.flatten() for m in modules])
        mask = method.compute_mask(scores, default)
        for m, part in zip(modules, mask.split([w.numel() for w in masked]), strict=True):
            m.weight_mask.copy_(part.view_as(m.weight_mask))

    # ---- reporting (host reads at logging steps and the end) --------------------------

    def _masks(self) -> dict[str, torch.Tensor]:
        if self.final_masks is not None:
            return self.final_masks
        return {name: m.weight_mask for name, m in self.modules.items()}

    def sparsity(self) -> tuple[int, int]:
        masks = list(self._masks().values())
        total = sum(m.numel() for m in masks)
        # HOST SYNC (logging step / end of run): one read of the pruned count.
        zeros = int(torch.stack([(m == 0).sum() for m in masks]).sum().item())
        return zeros, total

    def on_log(self, loop: Any, metrics: dict[str, float]) -> None:
        zeros, total = self.sparsity()
        metrics["prune/sparsity"] = zeros / total
        metrics["prune/target"] = self.target

    def on_fit_end(self, loop: Any) -> None:
        """Make the pruning permanent: plain `weight` parameters (the same Parameter objects
        the optimizer holds), no hooks. The masks are kept for a save after this (a stop)."""
        if self.final_masks is not None:
            return
        self.final_masks = {name: m.weight_mask.clone() for name, m in self.modules.items()}
        for m in self.modules.values():
            prune.remove(m, "weight")
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def summary(self, loop: Any) -> dict[str, Any]:
        zeros, total = self.sparsity()
        return {
            "prune": {
                "amount": self.amount,
                "method": self.method,
                "scope": self.scope,
                "sparsity": zeros / total,
                "pruned_weights": zeros,
                "prunable_weights": total,
                "layers": len(self.modules),
            }
        }

    # ---- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # HOST SYNC (checkpoint): the masks are copied to the file.
        masks = {name: mask.detach().bool().cpu() for name, mask in self._masks().items()}
        return {"masks": masks, "target": self.target}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.target = float(state.get("target", 0.0))
        for name, mask in state.get("masks", {}).items():
            module = self.modules.get(name)
            if module is not None and hasattr(module, "weight_mask"):
                module.weight_mask.copy_(mask.to(module.weight_mask.dtype))


def _save_plain(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict post-hook: `weight` = weight_orig * weight_mask instead of the two."""
    orig, mask = state.pop(prefix + "weight_orig", None), state.pop(prefix + "weight_mask", None)
    if orig is not None:
        state[prefix + "weight"] = orig * mask if mask is not None else orig


def _load_plain(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: a plain `weight` loads into weight_orig; the mask stays as it
    is (the technique state brings the saved one)."""
    key = prefix + "weight"
    if hasattr(module, "weight_orig") and key in state and prefix + "weight_orig" not in state:
        state[prefix + "weight_orig"] = state.pop(key)
        state.setdefault(prefix + "weight_mask", module.weight_mask)
