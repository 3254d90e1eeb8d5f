"""strategy=pipeline: the model as a chain of blocks, and where it is cut into stages.

How the model is cut. A model is a chain of blocks run one after the other: an nn.Sequential
(nested Sequentials are opened, so a ResNet-style `layer1.0` is a block), a torchvision ResNet
(stem, the residual blocks, pool, flatten, fc), or any model whose forward runs its top-level
children in order (checked on a real batch: a model whose forward does something else is
refused, not silently mis-split). Cuts go before blocks that hold parameters: automatically so
that the largest stage holds as few parameters as possible, or at `strategy.split_points`
(block names; a name like `layer3` means the first block inside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from accel_train.errors import UserError
from accel_train.precision import Precision


@dataclass
class Block:
    name: str  # fully-qualified name in the original model
    module: nn.Module
    flatten_before: bool = False  # torchvision ResNet: torch.flatten(x, 1) before `fc`
    params: int = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.flatten_before:
            x = torch.flatten(x, 1)
        return self.module(x)


def _open(name: str, module: nn.Module) -> list[Block]:
    """A block, or the blocks of a (nested) nn.Sequential."""
    if type(module) is nn.Sequential:
        return [b for n, child in module.named_children() for b in _open(f"{name}.{n}", child)]
    return [Block(name, module, params=sum(p.numel() for p in module.parameters()))]


def _is_torchvision_resnet(model: nn.Module) -> bool:
    return type(model).__name__ == "ResNet" and type(model).__module__.startswith("torchvision")


def chain(model: nn.Module, sample: torch.Tensor, target: str) -> list[Block]:
    """The model's blocks in execution order, checked against its own forward on `sample`."""
    blocks: list[Block] = []
    for name, child in model.named_children():
        blocks += _open(name, child)
    if _is_torchvision_resnet(model):
        # forward: stem, layer1..4, avgpool, torch.flatten(x, 1), fc (children in that order)
        blocks[-1].flatten_before = True
    own = [n for n, _ in model.named_parameters(recurse=False)]
    own += [n for n, _ in model.named_buffers(recurse=False)]
    if own:
        raise UserError(
            f"model._target_={target} has parameters of its own outside any child module "
            f"({', '.join(own[:4])}): strategy=pipeline can place only whole child modules on "
            "stages. Move them into a child module (e.g. an nn.Module holding the parameter)."
        )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(sample)
            x = sample
            for block in blocks:
                x = block(x)
        same = x.shape == expected.shape and torch.allclose(x, expected, rtol=1e-4, atol=1e-5)
    except Exception as err:  # the user's modules, called one by one
        same, why = False, f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
    else:
        why = "the outputs differ"
    finally:
        model.train(was_training)
    if not same:
        raise UserError(
            f"model._target_={target}: strategy=pipeline cuts a model into consecutive blocks, "
            "so its forward must run its child modules one after the other (as nn.Sequential "
            f"does); running them in order does not give the model's output ({why}). Make the "
            "model an nn.Sequential (or a torchvision ResNet), or train it with strategy=ddp "
            "or fsdp."
        )
    return blocks


def _matches(point: str, name: str) -> bool:
    return name == point or name.startswith(point + ".")


def split(blocks: list[Block], stages: int, split_points: list[str], target: str) -> list[int]:
    """Start index of each stage in `blocks`."""
    names = [b.name for b in blocks]
    if split_points:
        if len(split_points) != stages - 1:
            raise UserError(
                f"strategy.split_points={list(split_points)} gives {len(split_points) + 1} "
                f"stages but the pipeline has {stages} (strategy.stages, default: one per "
                f"process). Name {stages - 1} block(s), or `strategy.split_points=[]` to split "
                "automatically."
            )
        starts = [0]
        for point in split_points:
            hits = [i for i, n in enumerate(names) if _matches(point, n)]
            if not hits:
                raise UserError(
                    f"strategy.split_points: {point!r} is no block of model._target_={target}. "
                    f"Its blocks, in order: {', '.join(names[:40])}"
                    f"{' ...' if len(names) > 40 else ''}. Name one of those (or a parent, e.g. "
                    "`layer3`)."
                )
            if hits[0] <= starts[-1]:
                raise UserError(
                    f"strategy.split_points={list(split_points)}: {point!r} does not come after "
                    "the previous split point (or is the first block). List the points in the "
                    "order the model runs them, none at the very first block."
                )
            starts.append(hits[0])
        return starts
    # Cuts only before blocks holding parameters (a ReLU or pooling stays with its layer), and
    # not before the first one: every stage then holds parameters.
    cuts = [i for i, b in enumerate(blocks) if b.params > 0][1:]
    holding = sum(1 for b in blocks if b.params > 0)
    if holding < stages:
        raise UserError(
            f"strategy=pipeline with {stages} stages but model._target_={target} has only "
            f"{holding} block(s) with parameters to place "
            f"({', '.join(b.name for b in blocks if b.params)}): every stage "
            f"needs at least one. Use at most {holding} stages (`strategy.stages={holding}`), or "
            "train it with strategy=ddp."
        )
    return [0, *_balanced_cuts(blocks, cuts, stages)]


def _balanced_cuts(blocks: list[Block], cuts: list[int], stages: int) -> list[int]:
    """Choose stages-1 of `cuts` minimising the largest stage's parameter count (the linear
    partition problem, by dynamic programming: n is a few dozen blocks)."""
    prefix = [0]
    for b in blocks:
        prefix.append(prefix[-1] + b.params)
    points = [0, *cuts, len(blocks)]  # candidate stage boundaries
    n = len(points) - 1
    inf = float("inf")
    # best[k][j]: the smallest max-stage size splitting blocks[:points[j]] into k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(1, n + 1):
            for i in range(j):
                if best[k - 1][i] == inf:
                    continue
                cost = max(best[k - 1][i], prefix[points[j]] - prefix[points[i]])
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    chosen, j = [], n
    for k in range(stages, 0, -1):
        j = back[k][j]
        chosen.append(points[j])
    return sorted(chosen)[1:]


def activations(
    model: nn.Module, blocks: list[Block], sample: torch.Tensor, precision: Precision
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape without the batch dimension, dtype) of the input and of every block's output, as
    training computes them (under autocast). Given to the stages up front, so that torch's
    pipelining needs no shape-inference pass (which would run the loss on uninitialised
    tensors and feed them to the loss hooks)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), precision.autocast():
            found, x = [(tuple(sample.shape[1:]), sample.dtype)], sample
            for block in blocks:
                x = block(x)
                found.append((tuple(x.shape[1:]), x.dtype))
    finally:
        model.train(was_training)
    return found


def keep_blocks(model: nn.Module, keep: set[str], blocks: list[Block]) -> None:
    """Remove every block not in `keep` from the model (in place): the model then holds this
    stage's parameters under their original names."""
    for block in blocks:
        if block.name in keep:
            continue
        parent_name, _, leaf = block.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        del parent._modules[leaf]
