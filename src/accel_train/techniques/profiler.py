"""trainer.profile: a torch.profiler trace of a few steps into <run dir>/profile."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.profiler import (
    ProfilerActivity,
    profile,
    schedule,
    supported_activities,
    tensorboard_trace_handler,
)

from accel_train.techniques import Technique

log = logging.getLogger("accel_train")


class Profiler(Technique):
    """Records `steps` optimizer steps after one wait and one warm-up step (TensorBoard or
    Perfetto can open the trace)."""

    name = "profiler"

    def __init__(self, steps: int):
        self.steps = steps
        self.prof: profile | None = None

    def on_fit_start(self, loop: Any) -> None:
        activities = [ProfilerActivity.CPU]
        if loop.env.device.type == "cuda" and ProfilerActivity.CUDA in supported_activities():
            activities.append(ProfilerActivity.CUDA)
        if torch.version.cuda and not torch.cuda.is_available():
            # A CUDA build of torch on a machine without a CUDA driver: kineto asks the driver
            # for the GPUs' properties when it collects ANY trace (DeviceProperties.cpp, whatever
            # the activities), and prints "ERROR: gpuGetDeviceCount failed with code 35" and
            # USDT start/stop markers. Nothing is wrong with a CPU trace: keep kineto quiet
            # here (unless the user set its level), and only here.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self.trace_dir = loop.run_dir / "profile"
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=1, warmup=1, active=self.steps, repeat=1),
            on_trace_ready=tensorboard_trace_handler(
                str(self.trace_dir), worker_name=f"rank{loop.env.rank}"
            ),
            record_shapes=True,
        )
        self.prof.__enter__()

    def on_train_step_end(self, loop: Any) -> None:
        self.prof.step()

    def on_fit_end(self, loop: Any) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        self.prof = None
        if loop.env.is_main:
            log.info(
                "profiler trace written to %s (open in TensorBoard or ui.perfetto.dev)",
                self.trace_dir,
            )
