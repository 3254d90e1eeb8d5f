"""trainer.compile: torch.compile the model (after DDP/FSDP wrapping, as PyTorch recommends:
DDP's graph breaks at bucket boundaries let the all-reduce overlap the backward)."""

from __future__ import annotations

import torch
from torch import nn

from accel_train.techniques import COMPILE, BuildContext, Technique


class Compile(Technique):
    name = "compile"
    order = COMPILE

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        return torch.compile(model)
