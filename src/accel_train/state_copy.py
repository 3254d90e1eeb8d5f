"""Copies of a checkpoint's state made before training goes on (async_save.py), and which
storages only the optimizer step changes. Plain torch: imported by the checkpoint formats, which
every command's start-up imports, so it must not pull in torch.distributed.checkpoint."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch


def _storage(t: torch.Tensor) -> int:
    # A DTensor exists only once its module is imported (1 s of imports a command-line check
    # that never meets one should not pay).
    dtensor = sys.modules.get("torch.distributed.tensor")
    local = t.to_local() if dtensor and isinstance(t, dtensor.DTensor) else t  # this rank's shard
    return local.untyped_storage().data_ptr() if local.numel() else 0


def step_only_storages(model: torch.nn.Module, optimizer) -> set[int]:
    """The storages that only the optimizer step changes: the parameters and the optimizer's
    state. Everything else in a checkpoint is copied before the loop goes on."""
    tensors: Iterable[torch.Tensor] = [
        *model.parameters(),
        *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
    ]
    return {_storage(t) for t in tensors} - {0}


def copy_all_but(obj: Any, later: frozenset[int] | set[int] = frozenset()) -> Any:
    """`obj` with every tensor not in the storages `later` (none by default) replaced by a copy
    made now."""
    if isinstance(obj, torch.Tensor):
        return obj if _storage(obj) in later else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: copy_all_but(v, later) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_all_but(v, later) for v in obj]
    if isinstance(obj, tuple):
        return tuple(copy_all_but(v, later) for v in obj)
    return obj
