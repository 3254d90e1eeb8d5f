"""activation_checkpointing.mode: blocks keep only their inputs in the forward and recompute
their activations in the backward (torch.utils.checkpoint, non-reentrant): less memory for
about one more forward of compute.

Which blocks (in this order):

- `activation_checkpointing.classes=[pkg.mod.Block]`: the outermost modules of those classes;
- else the blocks the model declares (`block_names`: the built-in GPT's blocks, however few;
  model=timm's, from timm's grouping: a ViT's blocks, a ResNet's or EfficientNet's stages);
- else the model's repeated blocks: the outermost modules whose class occurs at least twice, that
  hold parameters and have children, and that are not plain containers (Sequential, ModuleList):
  torchvision ResNet's BasicBlocks/Bottlenecks, a transformer's layers;
- else a model that is one flat nn.Sequential (mnist_cnn, mlp) is cut into segments, one per
  layer with parameters plus the parameter-free layers after it (ReLU, pooling, dropout).

A model that checkpoints its own blocks (timm's `set_grad_checkpointing`) and has no BatchNorm
does it itself with `full` (a ViT's blocks, a ConvNeXt's): the placement its authors chose.

`full` checkpoints every block, `selective` every `activation_checkpointing.every`-th one
(blocks 0, every, 2 * every, ...). Blocks are wrapped with torch's `checkpoint_wrapper`, whose
state_dict hooks drop the wrapper from the keys: checkpoints stay loadable with it off, and
FSDP's shard units (strategy.wrap_classes, or the repeated blocks) still find the blocks.
Segments are checkpointed by the Sequential's own forward (no module moves, same keys).

Recomputing a block runs its forward twice, which would update BatchNorm's running statistics
twice per step (validation would then see other statistics than without checkpointing): the
recompute restores the block's buffers afterwards, so the run is the same with and without.
torch.compile (trainer.compile) refuses such custom contexts, and does not need them: its
recompute is inside the compiled graph, which updates the buffers once.

`activation_checkpointing.offload=true` (CUDA runs): what the forward saves for the backward is
copied to pinned host memory as it is saved and copied back as the backward needs it, through
torch's `save_on_cpu(pin_memory=True)` around each training micro-batch's forward (asynchronous
copies both ways: no host sync). It composes with every mode, because a checkpointed block
saves its inputs the same way (torch.utils.checkpoint's non-reentrant `_NoopSaveInputs`): with
`mode=off` every saved activation goes to the host, with `full` only the blocks' inputs are
saved (and so offloaded), with `selective` the inputs of the checkpointed blocks and the
activations of the others. Parameters stay where they are (torchtune's OffloadActivations'
rule: they are on the device anyway), and so do tensors under 1 KiB (a copy each is not worth
its launch).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

from accel_train.errors import UserError
from accel_train.techniques import MEMORY, BuildContext, Technique

log = logging.getLogger("accel_train")

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@contextlib.contextmanager
def _restoring(buffers: list[torch.Tensor]):
    """Undo what a recompute does to the buffers (BatchNorm's running statistics)."""
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        torch._foreach_copy_(buffers, saved)


def _contexts(modules: list[nn.Module]):
    """checkpoint's context_fn: nothing around the forward, buffers restored around the
    recompute."""
    buffers = [b for m in modules for b in m.buffers()]
    return contextlib.nullcontext(), _restoring(buffers) if buffers else contextlib.nullcontext()


class OffloadActivations(saved_tensors_hooks):
    """Saved tensors of `device_type` (cuda) moved to host memory while the backward does not
    need them: torch's save_on_cpu, minus parameters and tiny tensors (module docstring).
    `offloaded` counts the tensors sent (a Python int: no device read)."""

    MIN_BYTES = 1024

    def __init__(self, device_type: str = "cuda", pin_memory: bool = True):
        inner = save_on_cpu(pin_memory=pin_memory, device_type=device_type)
        self.offloaded = 0

        def pack(tensor: torch.Tensor):
            if (
                tensor.device.type != device_type
                or isinstance(tensor, nn.Parameter)
                or isinstance(tensor._base, nn.Parameter)  # a Linear saves its weight.t()
                or tensor.numel() * tensor.element_size() < self.MIN_BYTES
            ):
                return False, tensor
            self.offloaded += 1
            return True, inner.pack_hook(tensor)

        def unpack(packed) -> torch.Tensor:
            moved, value = packed
            return inner.unpack_hook(value) if moved else value

        super().__init__(pack, unpack)


class ActivationCheckpointing(Technique):
    name = "activation_checkpointing"
    order = MEMORY  # before DDP/FSDP wrap the blocks and before compile traces them

    def __init__(
        self, mode: str, every: int = 2, classes: list[str] | None = None, offload: bool = False
    ):
        self.mode, self.every, self.classes = mode, every, list(classes or [])
        self.offload = offload
        self.offloader: OffloadActivations | None = None  # made by wrap_loss (offload=true)

    @property
    def wraps_loss(self) -> bool:
        return self.offload  # checkpointing alone changes the model, not the step

    def wrap_loss(self, loop, compute):
        """offload=true: each training micro-batch's forward under the offloading hooks (the
        backward, after it, unpacks what they saved). The config refuses it on a CPU run."""
        if not self.offload:
            return compute
        device_type = loop.env.device.type
        self.offloader = OffloadActivations(device_type, pin_memory=device_type == "cuda")
        if loop.env.is_main:
            log.info("activation offloading: what the forward saves waits in pinned host memory")

        def offloaded(batch):
            with self.offloader:
                return compute(batch)

        return offloaded

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        if self.mode == "off":  # offload alone: nothing to wrap
            return model
        if self.mode == "full" and not self.classes and own_checkpointing(model):
            model.set_grad_checkpointing(True)
            if ctx.env.is_main:
                log.info("activation checkpointing (full): the model's own (timm's)")
            return model
        eager = not ctx.cfg.trainer.compile
        blocks = find_blocks(model, self.classes)
        if blocks:
            chosen = blocks if self.mode == "full" else blocks[:: self.every]
            for parent, name, block in chosen:
                ctx_fn = functools.partial(_contexts, [block]) if eager else None
                kwargs = {"context_fn": ctx_fn} if ctx_fn else {}
                wrapped = checkpoint_wrapper(
                    block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs
                )
                setattr(parent, name, wrapped)
            what = f"{len(chosen)} of {len(blocks)} blocks ({type(blocks[0][2]).__name__})"
        else:
            segments = sequential_segments(model)
            if len(segments) < 2:
                found = sorted({type(m).__name__ for m in model.modules()})
                raise UserError(
                    f"activation_checkpointing.mode={self.mode}: the model "
                    f"({type(model).__name__}) has no blocks to checkpoint: no class repeats as a "
                    "block with parameters, and it is not a flat nn.Sequential of several layers. "
                    "Name the block class(es) to checkpoint with `activation_checkpointing."
                    f"classes=[pkg.module.Block]` (the model has: {', '.join(found)}), or set "
                    "`activation_checkpointing.mode=off`."
                )
            step = 1 if self.mode == "full" else self.every
            chosen_at = set(range(0, len(segments), step))
            model.forward = functools.partial(  # type: ignore[method-assign]
                _segmented_forward, model, segments, chosen_at, eager
            )
            what = f"{len(chosen_at)} of {len(segments)} nn.Sequential segments"
        if ctx.env.is_main:
            log.info("activation checkpointing (%s): %s", self.mode, what)
        return model


def own_checkpointing(model: nn.Module) -> bool:
    """The model checkpoints its own blocks (timm's `set_grad_checkpointing`, a capability), and
    has no BatchNorm, whose running statistics its recompute would update a second time (the
    blocks wrapped here restore them: a BatchNorm model is wrapped here instead)."""
    return callable(getattr(model, "set_grad_checkpointing", None)) and not any(
        isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()
    )


def find_blocks(model: nn.Module, classes: list[str]) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, block) of the blocks to checkpoint, in forward order."""
    if classes:
        names = set(classes) | {c.rsplit(".", 1)[-1] for c in classes}

        def wanted(m: nn.Module) -> bool:
            cls = type(m)
            return cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names

        found = _outermost(model, wanted)
        if not found:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise UserError(
                f"activation_checkpointing.classes={classes}: the model has no module of those "
                f"classes (it has: {', '.join(present)}). Name classes from that list, or [] "
                "for the model's repeated blocks."
            )
        return found
    declared = _declared(model)
    if declared:
        return declared
    counts = Counter(type(m) for m in model.modules() if m is not model)

    def is_block(m: nn.Module) -> bool:
        return (
            counts[type(m)] >= 2
            and not isinstance(m, CONTAINERS)
            and any(True for _ in m.children())
            and any(True for _ in m.parameters())
        )

    return _outermost(model, is_block)


def _declared(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """The blocks the model names itself (`block_names`, a capability: model=timm's, from
    timm's own grouping), as (parent, attribute, block); [] when none or no longer there."""
    found = []
    try:
        for name in getattr(model, "block_names", None) or ():
            parent, _, attr = name.rpartition(".")
            found.append((model.get_submodule(parent), attr, model.get_submodule(name)))
    except AttributeError:
        return []
    return found


def _outermost(model: nn.Module, wanted) -> list[tuple[nn.Module, str, nn.Module]]:
    found: list[tuple[nn.Module, str, nn.Module]] = []

    def visit(module: nn.Module) -> None:
        for name, child in module.named_children():
            if wanted(child):
                found.append((module, name, child))
            else:
                visit(child)

    visit(model)
    return found


def sequential_segments(model: nn.Module) -> list[list[nn.Module]]:
    """A flat nn.Sequential cut before each layer with parameters but the first ([] for other
    models)."""
    if not isinstance(model, nn.Sequential):
        return []
    segments: list[list[nn.Module]] = [[]]
    has_params = False  # the open segment has a layer with parameters
    for layer in model:
        # An adapter around one layer (PEFT's LoRA: `get_base_layer`) is still one layer.
        wrapped = hasattr(layer, "get_base_layer")
        if any(True for _ in layer.children()) and not wrapped:
            return []  # not flat: its sub-blocks would need a policy of their own
        params = any(True for _ in layer.parameters(recurse=wrapped))
        if params and has_params:
            segments.append([])
        segments[-1].append(layer)
        has_params = has_params or params
    return [s for s in segments if s]


def _run(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def _segmented_forward(model, segments, chosen_at, eager, x):
    for i, layers in enumerate(segments):
        if i in chosen_at and torch.is_grad_enabled():
            kwargs = {"context_fn": functools.partial(_contexts, layers)} if eager else {}
            x = checkpoint(_run, layers, x, use_reentrant=False, **kwargs)
        else:
            x = _run(layers, x)
    return x
