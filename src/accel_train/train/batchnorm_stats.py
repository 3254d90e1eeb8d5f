"""Whether a model's BatchNorm running statistics can be trusted in evaluation mode.

A BatchNorm layer normalises by its running mean and variance in evaluation mode. They start at
0 and 1 and move towards the training batches' statistics by ``momentum`` (0.1) a batch, so
after k batches (1 - momentum)^k of each is still the initial value: 43 % after 8 batches. A deep
model evaluated then can be far off the one that trains (torchvision's r3d_18 after a few tiny
batches: every video predicted as one class, a validation loss of 1e16). The numbers are then
not wrong, but they say little; the log says so once, at the first evaluation that is affected.

Only layers that start from their initial statistics are judged (``mark_fresh``, after the
model's weights are loaded): loaded statistics (pretrained weights, a checkpoint) are not.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("accel_train")

FRESH = "_accel_fresh_stats"  # set on a BatchNorm whose statistics start at 0 and 1
UNSETTLED = 0.05  # the share of the initial statistics above which the log warns
_warned: list[bool] = []  # [True] once warned (once a process: validation, then the test pass)


def mark_fresh(model: nn.Module) -> None:
    """Mark the BatchNorm layers whose running statistics are the initial ones (no weights
    loaded into them)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_var is not None:
            with torch.no_grad():
                fresh = not m.running_mean.any() and bool((m.running_var == 1).all())
            setattr(m, FRESH, fresh)


def warn_if_unsettled(model: nn.Module) -> None:
    """One warning a process when a fresh BatchNorm layer has seen too few training batches
    for its running statistics (module docstring)."""
    if _warned:
        return
    layers = [m for m in model.modules() if getattr(m, FRESH, False)]
    if not layers:
        return
    seen = min(int(m.num_batches_tracked) for m in layers)
    momentum = layers[0].momentum
    # (momentum None: a cumulative average, the initial values gone after one batch)
    share = (1 - momentum) ** seen if momentum is not None else float(seen == 0)
    if share <= UNSETTLED:
        return
    _warned.append(True)
    enough = f"; about {_batches_needed(momentum)} batches make them reliable" if momentum else ""
    log.warning(
        "evaluation: the model's BatchNorm layers normalise by running statistics of only %d "
        "training batch(es) (momentum %s: %.0f%% of them is still the initial mean 0 and "
        "variance 1)%s. Evaluation-mode outputs can then be far off the training ones (a very "
        "large val/loss, one class predicted for everything): judge the validation numbers of "
        "later evaluations, after more training steps.",
        seen, momentum, 100 * share, enough,
    )  # fmt: skip


def _batches_needed(momentum: float) -> int:
    k = 0
    while (1 - momentum) ** k > UNSETTLED:
        k += 1
    return k
