"""Tensor parallelism (torch.distributed.tensor.parallel) on the run's `tp` mesh dimension.

Which layers are sharded, in this order of precedence:
  1. `strategy.tp_plan`: module name pattern (fnmatch, e.g. `blocks.*.attn.q`) -> `colwise` /
     `rowwise` / `sequence`, for a user's model;
  2. the plan the model declares for itself (`model.tp_plan(sequence_parallel)`): the built-in
     GPT's (attention q/k/v and MLP up column-wise, attention out and MLP down row-wise) and a
     Hugging Face model's own (`base_model_tp_plan`, through models/hf.py);
  3. none: refused, naming `strategy.tp_plan`.

A column-wise layer keeps 1/tp of its output features, the row-wise layer after it 1/tp of its
input features and all-reduces its output: one all-reduce per attention and per MLP forward
(and one in backward). Parameters outside the plan (embeddings, norms) stay whole on every
rank; their gradients are equal on every rank of a TP group, since the all-reduces make the
activations equal. Under `strategy.sequence_parallel` the norms and dropouts between the
sharded layers run on 1/tp of the sequence instead (the all-reduce becomes a reduce-scatter
plus an all-gather: the same traffic, less activation memory).
"""

from __future__ import annotations

import fnmatch
import logging
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Replicate

from accel_train.errors import UserError

log = logging.getLogger("accel_train")

STYLES = ("colwise", "rowwise", "sequence")
# Hugging Face's plan names beyond ours (transformers' tensor_parallel.py): the same layers,
# with the output gathered (`_rep`) where the model needs it whole.
_HF_STYLES = {
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
}


def style(name: str, where: str) -> ParallelStyle:
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "sequence":
        return SequenceParallel()
    if name in _HF_STYLES:
        return _HF_STYLES[name]()
    raise UserError(
        f"{where}: `{name}` is not a tensor-parallel style accel-train knows; use one of "
        f"{', '.join(STYLES)} (colwise for the layer that widens, rowwise for the one after it)."
    )


def resolve_plan(model: nn.Module, tp_plan: dict[str, str], sequence_parallel: bool):
    """{module name: ParallelStyle} for this model (see the module docstring)."""
    if tp_plan:
        return _match(model, {k: style(v, f"strategy.tp_plan.{k}") for k, v in tp_plan.items()})
    declared = getattr(model, "tp_plan", None)
    plan = declared(sequence_parallel=sequence_parallel) if callable(declared) else {}
    if not plan:
        raise UserError(
            f"tensor parallelism for model {type(model).__name__}: it declares no plan of its own "
            "(the built-in GPT and Hugging Face models with a `base_model_tp_plan` do). Give "
            "`strategy.tp_plan` (module name pattern -> colwise / rowwise / sequence): colwise "
            "for a layer that widens and rowwise for the one after it, e.g. "
            f"{example_plan(model)}."
        )
    return _match(
        model, {k: v if isinstance(v, ParallelStyle) else style(v, k) for k, v in plan.items()}
    )


def example_plan(model: nn.Module) -> str:
    """A `strategy.tp_plan` override for this model's first two Linear layers, as Hydra parses
    it on a command line: a dict whose keys are bare (a quoted key does not parse), quoted for
    the shell. (`+`: the schema's empty dict takes no new key without it.)"""
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:2]
    first, second = (linear + ["layers.*.fc1", "layers.*.fc2"][len(linear) :])[:2]
    return f"`'+strategy.tp_plan={{{first}: colwise, {second}: rowwise}}'`"


def _match(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Patterns -> the concrete module names they match; a pattern matching none is refused."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, ParallelStyle] = {}
    for pattern, parallel_style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            shown = ", ".join(n for n, m in model.named_modules() if isinstance(m, nn.Linear))
            raise UserError(
                f"strategy.tp_plan: the pattern `{pattern}` matches no module of "
                f"{type(model).__name__} (its Linear layers: {shown[:400]}). Use those names, "
                "with `*` for the block index (e.g. `blocks.*.attn.q`)."
            )
        for hit in hits:
            out.setdefault(hit, parallel_style)
    return out


def heads(model: nn.Module) -> list[tuple[str, int]]:
    """(key, count) of the attention heads a TP degree must divide, where the model says."""
    found = []
    if isinstance(getattr(model, "n_head", None), int):
        found.append(("model.n_head", model.n_head))
    config = getattr(getattr(model, "hf", None), "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            found.append((f"the model's config.json {attr}", value))
    return found


def apply_tp(model: nn.Module, mesh: DeviceMesh, strategy_cfg) -> nn.Module:
    """Shard `model`'s planned layers over `mesh` (the run's `tp` dimension), in place."""
    tp = mesh.size()
    for key, count in heads(model):
        if count % tp:
            raise UserError(
                f"strategy.tp={tp} does not divide {key}={count}: tensor parallelism gives each "
                f"process whole attention heads. Use a `strategy.tp` that divides {count}."
            )
    user = {str(k): str(v) for k, v in (strategy_cfg.get("tp_plan") or {}).items()}
    plan = resolve_plan(model, user, bool(strategy_cfg.sequence_parallel))
    out_of_place(model)
    model = parallelize_module(model, mesh, plan)
    if dist.get_rank() == 0:
        styles = defaultdict(int)
        for parallel_style in plan.values():
            styles[type(parallel_style).__name__] += 1
        shown = ", ".join(f"{n} {name}" for name, n in sorted(styles.items()))
        log.info("tensor parallel over %d processes: %d modules (%s)", tp, len(plan), shown)
    return model


def out_of_place(model: nn.Module) -> None:
    """Activations and dropouts built with `inplace=True` (the built-in CNNs' and MLP's ReLUs,
    torchvision's, many users' own) compute out of place: a sharded layer's output is a view
    that DTensor's backward owns, and autograd forbids modifying it in place ("Output 0 of
    _ToTorchTensor is a view and is being modified inplace"). The same values, one more
    activation tensor each."""
    for module in model.modules():
        if getattr(module, "inplace", None) is True:
            module.inplace = False


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a DTensor (the tensor itself otherwise): in-place arithmetic on
    it changes the DTensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ for a mix of whole tensors and DTensors on several meshes (TP
    shards some layers; FSDP x TP puts others on the data mesh only): each sharded gradient's
    squared norm is summed over the mesh dimensions it is sharded on, once per layout, on the
    device (no host sync)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    plain: list[torch.Tensor] = []
    by_layout: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if isinstance(g, DTensor):
            by_layout[(g.device_mesh, tuple(g.placements))].append(g.to_local())
        else:
            plain.append(g)
    device = (plain or [t for ts in by_layout.values() for t in ts])[0].device
    total = torch.zeros((), device=device, dtype=torch.float32)
    for g in plain:
        total += g.detach().float().pow(2).sum()
    for (mesh, placements), locals_ in by_layout.items():
        part = sum(t.detach().float().pow(2).sum() for t in locals_)
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():  # Shard, and FSDP x TP's _StridedShard
                dist.all_reduce(part, group=mesh.get_group(dim))
        total += part
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local(g).mul_(coef.to(g.dtype))
    return norm
