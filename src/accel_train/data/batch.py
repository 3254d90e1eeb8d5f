"""Batches of any structure: a tensor, a tuple or list, a dict, nested. One function moves a
batch to the device, one counts its samples, two cut it; none reads a value on the host (the
sample count is a shape, which the host knows without waiting for the device)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor in `batch` moved to `device`, non-blocking (from pinned memory this is an
    asynchronous copy); everything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor met in `batch` (depth first), None when it holds none."""
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, Sequence | type({}.values())) and not isinstance(values, str | bytes):
        for value in values:
            found = first_tensor(value)
            if found is not None:
                return found
    return None


def count_samples(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor (Composer's
    `_default_get_num_samples_in_batch` does the same for tensors, sequences and mappings)."""
    found = first_tensor(batch)
    if found is None or found.dim() == 0:
        raise TypeError(f"a batch of {type(batch).__name__} holds no batched tensor")
    return found.shape[0]


def _map(batch: Any, fn) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch) if batch.dim() > 0 else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _map(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_map(v, fn) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_map(v, fn) for v in batch)
    return batch


def take(batch: Any, k: int) -> Any:
    """The first k samples of every batched tensor (evaluation drops its padding this way)."""
    return _map(batch, lambda t: t[:k])


def select(batch: Any, index: torch.Tensor) -> Any:
    """The samples at `index` (a device tensor) of every batched tensor: no host read."""
    return _map(batch, lambda t: t[index])


def cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor cast to `dtype` (integer tensors, e.g. token ids, stay)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: cast_floats(v, dtype) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(cast_floats(v, dtype) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(cast_floats(v, dtype) for v in batch)
    return batch
