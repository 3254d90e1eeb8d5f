"""trainer.channels_last: NHWC memory format for conv nets (tensor cores on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from accel_train.techniques import LAYOUT, BuildContext, Technique


class ChannelsLast(Technique):
    name = "channels_last"
    order = LAYOUT  # before DDP/FSDP wrap the parameters and before compile traces the layout

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        # The inputs must match, or every conv converts them back and forth.
        ctx.batch_transform.memory_format = torch.channels_last
        return model.to(memory_format=torch.channels_last)
