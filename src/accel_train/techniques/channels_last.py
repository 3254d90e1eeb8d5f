"""trainer.channels_last: NHWC memory format for conv nets (tensor cores on CUDA); NDHWC
(`torch.channels_last_3d`) for a model of 3-D convolutions, whose inputs are clips
(N, C, T, H, W): each 4-D tensor takes channels_last, each 5-D one channels_last_3d, and the
inputs the format of the model's convolutions (a 5-D tensor cannot be channels_last, nor a 4-D
one channels_last_3d: `Module.to(memory_format=...)` applies one format to both).

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


def input_format(model: nn.Module) -> torch.memory_format:
    """The inputs' format: channels_last_3d for a model of 3-D convolutions (clips), else
    channels_last."""
    clips = any(isinstance(m, nn.Conv3d) for m in model.modules())
    return torch.channels_last_3d if clips else torch.channels_last


def to_channels_last(model: nn.Module) -> nn.Module:
    """Every 4-D parameter and buffer channels_last, every 5-D one channels_last_3d (what
    Module.to does for one format, per tensor rank; their gradients follow)."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return model._apply(
        lambda t: t.contiguous(memory_format=formats[t.dim()]) if t.dim() in formats else t
    )


class ChannelsLast(Technique):
    name = "channels_last"
    order = LAYOUT  # before DDP/FSDP wrap the parameters and before compile traces the layout

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        # The inputs must match, or every conv converts them back and forth.
        ctx.batch_transform.memory_format = input_format(model)
        if keeps_parameters_contiguous(ctx):
            if ctx.env.is_main:
                log.info(
                    "channels_last with strategy=fsdp: inputs (and so activations) in NHWC, "
                    "parameters kept contiguous (FSDP2 shards only contiguous parameters)"
                )
            return model
        return to_channels_last(model)
