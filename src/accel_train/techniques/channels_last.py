"""trainer.channels_last: NHWC memory format for conv nets (tensor cores on CUDA); NDHWC
(channels_last_3d) for 3-D conv nets and their (N, C, T, H, W) clips.

Under FSDP (strategy=fsdp with several processes) only the inputs are converted: FSDP2 shards
a parameter by flattening its storage and refuses non-contiguous ones (a channels_last 4-D
weight is one). The convolutions still run in NHWC, since PyTorch's conv kernels (oneDNN on the
CPU, cuDNN on CUDA) pick the channels_last path when the input is channels_last and keep their
outputs in it; the weights are converted inside the kernel, once per call. Whether that still
pays is measured by scripts/bench/fsdp_channels_last.sh."""

from __future__ import annotations

import logging

import torch
from torch import nn

from accel_train.techniques import LAYOUT, BuildContext, Technique

log = logging.getLogger("accel_train")


def keeps_parameters_contiguous(ctx: BuildContext) -> bool:
    """True where the model's parameters will be sharded (FSDP2 in a process group), which
    shards only contiguous parameters."""
    return ctx.strategy.shards_parameters and ctx.env.distributed


class ChannelsLast(Technique):
    name = "channels_last"
    order = LAYOUT  # before DDP/FSDP wrap the parameters and before compile traces the layout

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        # The inputs must match, or every conv converts them back and forth.
        ctx.batch_transform.memory_format = torch.channels_last
        if keeps_parameters_contiguous(ctx):
            if ctx.env.is_main:
                log.info(
                    "channels_last with strategy=fsdp: inputs (and so activations) in NHWC, "
                    "parameters kept contiguous (FSDP2 shards only contiguous parameters)"
                )
            return model
        return to_channels_last(model)


def to_channels_last(model: nn.Module) -> nn.Module:
    """4-D parameters and buffers (Conv2d weights) channels_last, 5-D ones (Conv3d weights, a
    video model's) channels_last_3d: ``model.to(memory_format=channels_last)`` refuses 5-D."""

    def convert(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 4:
            return t.contiguous(memory_format=torch.channels_last)
        if t.dim() == 5:
            return t.contiguous(memory_format=torch.channels_last_3d)
        return t

    return model._apply(convert)
