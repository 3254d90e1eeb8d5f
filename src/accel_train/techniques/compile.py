"""trainer.compile: torch.compile the model (after DDP/FSDP wrapping, as PyTorch recommends:
DDP's graph breaks at bucket boundaries let the all-reduce overlap the backward).

torch.compile is lazy: the model compiles during the first step, which on a CPU can take a minute
in silence. So the run says so before it starts, and how long that first step took once it is
done (host time: compiling is host work, and no device sync is needed to see it)."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from accel_train.techniques import COMPILE, BuildContext, Technique

log = logging.getLogger("accel_train")


class Compile(Technique):
    name = "compile"
    order = COMPILE

    def __init__(self) -> None:
        self.started: float | None = None  # the first step's start, until it ends

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        return torch.compile(model)

    def on_fit_start(self, loop: Any) -> None:
        if loop.env.is_main:
            log.info("compiling the model (the first step takes longer)")
        self.started = time.perf_counter()

    def on_train_step_end(self, loop: Any) -> None:
        if self.started is None:
            return
        seconds, self.started = time.perf_counter() - self.started, None
        if loop.env.is_main:
            log.info("compiled: the first step, compiling included, took %.1f s", seconds)
