"""strategy=ddp: DistributedDataParallel, one replica per process, gradients all-reduced in
buckets on the mesh's `dp_replicate` dimension."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel_train.config.schema import DdpConfig
from accel_train.parallel import DistEnv
from accel_train.plugins import register_strategy
from accel_train.precision import Precision
from accel_train.strategies.base import Strategy, Wrapped


@register_strategy("ddp", DdpConfig)
class DDP(Strategy):
    name = "ddp"
    replicates_buffers = True

    def wrap(self, module: nn.Module, env: DistEnv, sample: Any, precision: Precision) -> Wrapped:
        if not env.distributed:
            return Wrapped(module, module, module)
        sc = self.cfg
        model = DistributedDataParallel(
            module,
            device_ids=[env.device.index] if env.device.type == "cuda" else None,
            process_group=self.mesh(env)["dp_replicate"].get_group(),
            bucket_cap_mb=sc.bucket_cap_mb,
            gradient_as_bucket_view=sc.gradient_as_bucket_view,
            static_graph=sc.static_graph,
            find_unused_parameters=sc.find_unused_parameters,
        )
        # Validation calls the bare module: DDP's forward may broadcast buffers (a collective)
        # and the ranks validate unevenly.
        return Wrapped(model, module, module)
