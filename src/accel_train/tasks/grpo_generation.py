"""task=grpo's sampling around the model: the model under its wrappers (DDP, torch.compile), a
model that FSDP2 shards gathered whole for the generation, and model=gpt's sampling loop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from accel_train.models.generate import generate as nano_generate
from accel_train.models.generate import generate_cached


def unwrapped(model: nn.Module) -> nn.Module:
    """The model under DDP's or torch.compile's wrapper (generation calls it directly)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, nn.parallel.DistributedDataParallel):
            inner = model.module
        if inner is None:
            return model
        model = inner


def _sharded_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 (`fully_shard`) made into units, the root first (FSDPModule's methods,
    asked of the module: no import of torch.distributed.fsdp for unsharded runs)."""
    return [m for m in model.modules() if hasattr(m, "set_reshard_after_forward")]


@contextlib.contextmanager
def gathered(model: nn.Module, root_forward: Callable[[], object], reshard_after_forward: bool):
    """FSDP2: every unit's parameters all-gathered once for the whole generation, and freed
    after; else nothing. transformers' generate calls the inner model, never the root's forward,
    so FSDP2 would take the first block it runs for the root (its lazy init) and the training
    step's root forward then fails. Here a one-token forward through the root (`root_forward`,
    under no_grad) comes first, with `reshard_after_forward` off on every unit: that forward
    makes the root the root and leaves every unit gathered, so the decoding loop runs no
    collective at all (each process may stop at its own length) and gathers nothing per token.
    The cost: the whole model on each process while it samples, as TRL's ZeRO-3 generation.
    `reshard_after_forward`: the strategy's setting, put back after."""
    units = _sharded_units(model)
    if not units:
        yield
        return
    units[0].set_reshard_after_forward(False)  # (recursive: every unit)
    try:
        root_forward()
        for unit in units:  # a unit the forward did not run (a module outside the forward)
            unit.unshard()
        yield
    finally:
        units[0].set_reshard_after_forward(bool(reshard_after_forward))
        for unit in units:
            unit.reshard()


def nano_sample(bare: nn.Module, ids: torch.Tensor, mask: torch.Tensor, group: int,
                max_len: int, prompts_together: int | None = None,
                **sampling) -> torch.Tensor:  # fmt: skip
    """model=gpt: (N, max_len) completions of the left-padded prompts `ids` (N, P), each prompt
    given `group` times in a row. With the model's KV cache (`decode`): each prompt's prefill
    runs once and is repeated to its group's rows, `prompts_together` prompts (None: all) per
    call, left padding masked. Without one (or where prompt + completion passes block_size
    with padding: the sliding window would see the padding), nanoGPT's loop one prompt at a
    time. `sampling`: temperature, top_k, top_p."""
    cached = hasattr(bare, "decode") and ids.shape[1] < bare.block_size
    fits = ids.shape[1] + max_len <= bare.block_size
    step = (prompts_together or ids.shape[0]) if cached and fits else 1
    firsts, rows = ids[::group], []
    valid = mask[::group].bool()
    for start in range(0, firsts.shape[0], step):
        chunk, keep = firsts[start : start + step], valid[start : start + step]
        if chunk.shape[0] == 1:  # one prompt: its padding cut off, no mask needed
            chunk, keep = chunk[:, keep[0]], None
        elif bool(keep.all()):  # HOST SYNC (once per chunk): no padding, no mask
            keep = None
        if cached:
            out = generate_cached(bare, chunk, max_len, block_size=bare.block_size,
                                  valid=keep, repeat=group, **sampling)  # fmt: skip
        else:
            out = nano_generate(bare, chunk.repeat_interleave(group, 0), max_len,
                                block_size=bare.block_size, **sampling)  # fmt: skip
        rows.append(out[:, chunk.shape[1] :])
    return torch.cat(rows)
