"""strategy=pipeline: the model cut into consecutive stages, one per process, trained by a
torch.distributed.pipelining schedule (pipeline_schedule.py: how the model is cut, the
schedule, validation's stage-to-stage forward); with more processes than stages, the pipelines
are replicated under DDP on the mesh's `dp_replicate` dimension."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from accel_train.config.schema import PipelineConfig
from accel_train.parallel import DistEnv
from accel_train.plugins import register_strategy
from accel_train.precision import Precision
from accel_train.strategies.base import Strategy, Wrapped
from accel_train.strategies.mesh import MeshLayout
from accel_train.strategies.pipeline_schedule import (
    Pipeline,
    PipelineEval,
    build_pipeline,
    check_pipeline,
    pipeline_stages,
)


@register_strategy("pipeline", PipelineConfig)
class PipelineParallel(Strategy):
    name = "pipeline"
    sharded_checkpoints = True
    optimizer_state_by_name = True

    @classmethod
    def runs_whole_model(cls, cfg: Any) -> bool:
        return False  # each process holds its stages

    def __init__(self, run_cfg: DictConfig):
        super().__init__(run_cfg)
        self.pipe: Pipeline | None = None  # this process's stage, once `wrap` has cut the model

    def layout(self, world: int) -> MeshLayout:
        stages = pipeline_stages(self.cfg, world, self.keys)
        return MeshLayout(dp_replicate=world // stages, pp=stages, keep=("dp_replicate", "pp"))

    def check_world(self, world: int | None, nproc: int, nnodes: str) -> None:
        check_pipeline(self.run_cfg, world, self.keys)
        super().check_world(world, nproc, nnodes)

    def wrap(self, module: nn.Module, env: DistEnv, sample: Any, precision: Precision) -> Wrapped:
        if not env.distributed:
            return Wrapped(module, module, module)
        lay = self.layout(env.world_size)
        mesh = self.mesh(env)
        # The model is cut here (in place: `module` keeps this stage's blocks, original names).
        self.pipe = build_pipeline(module, self.run_cfg, env, sample, precision, mesh, lay)
        return Wrapped(self.pipe.train_module, PipelineEval(self.pipe), self.pipe.stage_module.root)

    def owns_forward_backward(self, env: DistEnv) -> bool:
        return env.distributed

    def forward_backward(self, task, batch, weight: float, scaler) -> torch.Tensor:
        """The schedule's step: forward and backward of all stages, the loss on the last."""
        x, labels = task.loss_split(batch)
        return self.pipe.step(x, labels, weight, task.loss_fn, scaler)

    def before_optimizer_step(self) -> None:
        if self.pipe is not None and self.pipe.shared:
            self.pipe.sync_shared_grads()  # tied weights on two stages: one gradient

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        if self.pipe is None:
            return super().clip_grad_norm_(parameters, max_norm)
        return self.pipe.clip_grad_norm_(parameters, max_norm)  # the norm over all stages

    def logged_samples(self, samples: int) -> int:
        return samples if self.pipe is None else self.pipe.counted(samples)

    def parameter_count(self, module: nn.Module) -> int:
        return self.pipe.total_params if self.pipe is not None else super().parameter_count(module)

    def describe_processes(self, world: int) -> str:
        if self.pipe is None:
            return ""
        return (
            f" (x {self.pipe.layout.stages} pipeline stages = {world} processes, "
            f"{self.pipe.microbatches} micro-batches each)"
        )
