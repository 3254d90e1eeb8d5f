"""Which model transforms each multi-process strategy supports: one table, checked at compose.

Every pair of a strategy (ddp, fsdp, pipeline, tp) and a model transform (compile, channels_last,
activation checkpointing, QAT, pruning, LoRA) either works or is refused here, before any process
starts, with one paragraph naming both keys and the way out. tests/test_strategy_transforms.py
checks every pair and runs the working ones in real 2-process runs.

How the working pairs fit together (techniques/__init__.py has the order):
  * channels_last under FSDP converts the inputs only: FSDP2 shards only contiguous parameters,
    and a conv with a channels_last input runs (and returns) NHWC anyway (techniques/
    channels_last.py).
  * under pipeline, every transform before the parallel wrap runs on the whole model before it
    is cut (train/build.py, pipeline_transforms).
  * the `tp` rows hold for strategy=tp and for FSDP x TP (`strategy=fsdp strategy.tp=N`, N > 1)
    alike: activation checkpointing wraps the blocks before the plan shards their layers (the
    plan's `*` patterns match through the wrapper's name), compile compiles the sharded model.
"""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig

from accel_train.errors import UserError

# transform -> (the key that turns it on, as a user writes it; is it on in this config?)
TRANSFORMS: dict[str, tuple[str, Callable[[DictConfig], bool]]] = {
    "compile": ("trainer.compile=true", lambda cfg: bool(cfg.trainer.compile)),
    "channels_last": ("trainer.channels_last=true", lambda cfg: bool(cfg.trainer.channels_last)),
    "activation_checkpointing": (
        "activation_checkpointing.mode",
        lambda cfg: cfg.activation_checkpointing.mode != "off",
    ),
    "qat": ("quant=qat", lambda cfg: cfg.quant.name == "qat"),
    "prune": ("prune.amount", lambda cfg: cfg.prune.amount > 0),
    "lora": ("lora.rank", lambda cfg: cfg.lora.rank > 0),
}

STRATEGIES = ("ddp", "fsdp", "pipeline", "tp")

# (strategy, transform) -> why it is refused and what to do instead. A pair not listed works.
REFUSED: dict[tuple[str, str], str] = {
    ("fsdp", "qat"): (
        "quant=qat with strategy=fsdp is not supported by accel-train: torchao's fake-quantized "
        "Linear is not tested under FSDP2 sharding here (nor is exporting its sharded "
        "checkpoints). Use `strategy=ddp` (or single) with quant=qat, or `quant=none`."
    ),
    ("fsdp", "prune"): (
        "prune with strategy=fsdp is not supported: torch.nn.utils.prune keeps a full mask per "
        "weight and ranks the weights of the whole model, while fsdp spreads the weights over "
        "the ranks. Use `strategy=ddp` (or single), or `prune.amount=0`."
    ),
    ("pipeline", "prune"): (
        "prune with strategy=pipeline is not supported: torch.nn.utils.prune keeps a full mask "
        "per weight and ranks the weights of the whole model, while pipeline spreads the layers "
        "over the ranks. Use `strategy=ddp` (or single), or `prune.amount=0`."
    ),
    ("pipeline", "lora"): (
        "lora.rank with strategy=pipeline is not supported: the adapters' checkpoint rules (the "
        "frozen base left out and fingerprinted) are not wired into the pipeline's per-stage "
        "checkpoints. Use `strategy=fsdp` or `strategy=ddp` (FSDP shards the frozen base too), "
        "or `lora.rank=0`."
    ),
    ("pipeline", "compile"): (
        "trainer.compile with strategy=pipeline: torch.compile of the stage modules is not "
        "wired in (the pipeline schedule calls the stage modules itself). Turn it off "
        "(`trainer.compile=false`) or train with `strategy=ddp` or `strategy=fsdp`."
    ),
    ("tp", "lora"): (
        "lora.rank with strategy=tp (or strategy.tp under fsdp) is not supported: the LoRA "
        "wrappers replace the Linear layers the tensor-parallel plan shards, and torch's "
        "ColwiseParallel / RowwiseParallel shard plain nn.Linear only. Use `strategy=fsdp` "
        "without strategy.tp (FSDP shards the frozen base too), or `lora.rank=0`."
    ),
    ("tp", "qat"): (
        "quant=qat with strategy=tp (or strategy.tp under fsdp) is not supported: torchao's "
        "fake-quantized Linear is not an nn.Linear the tensor-parallel plan can shard. Use "
        "`strategy=ddp` (or single) with quant=qat, or `quant=none`."
    ),
    ("tp", "prune"): (
        "prune with strategy=tp (or strategy.tp under fsdp) is not supported: torch.nn.utils."
        "prune keeps a full mask per weight while tensor parallelism shards the weights over the "
        "ranks. Use `strategy=ddp` (or single), or `prune.amount=0`."
    ),
    ("tp", "channels_last"): (
        "trainer.channels_last with strategy=tp (or strategy.tp under fsdp): channels_last is "
        "for convolutions, and tensor parallelism here shards Linear and Embedding layers only "
        "(a transformer's). Turn it off (`trainer.channels_last=false`) or train a conv net with "
        "`strategy=ddp` or `strategy=fsdp`."
    ),
}


# (strategy, optimizer) -> why it is refused. torch.optim.Muon orthogonalises each whole weight
# matrix, which a sharded parameter does not hold on any one rank.
OPTIMIZER_REFUSED: dict[tuple[str, str], str] = {
    ("fsdp", "muon"): (
        "optimizer=muon with strategy=fsdp is not supported: torch.optim.Muon orthogonalises "
        "each whole weight matrix, and FSDP holds only a shard of it on each rank. Use "
        "`strategy=ddp` with optimizer=muon, or `optimizer=adamw` with FSDP."
    ),
    ("tp", "muon"): (
        "optimizer=muon with strategy=tp (or strategy.tp > 1) is not supported: "
        "torch.optim.Muon orthogonalises each whole weight matrix, and tensor parallelism "
        "holds only a slice of it on each rank. Use `strategy=ddp` with optimizer=muon, or "
        "`optimizer=adamw` with tensor parallelism."
    ),
    ("pipeline", "muon"): (
        "optimizer=muon with strategy=pipeline is not supported: the pipeline's sharded "
        "checkpoints go through torch.distributed.checkpoint's optimizer state, which "
        "accel-train's combined Muon + AdamW optimizer is not tested with. Use `strategy=ddp` "
        "with optimizer=muon, or `optimizer=adamw` with the pipeline."
    ),
}


# Strategies refused outright, whatever else the config says.
STRATEGY_REFUSED: dict[str, str] = {
    "dp": (
        "strategy=dp (torch.nn.DataParallel) is not supported: it drives all GPUs from one "
        "Python process, scatters inputs and gathers outputs through GPU 0 every step, and is "
        "slower than DistributedDataParallel even on a single node (PyTorch's docs say so). "
        "Use `strategy=ddp launcher.nproc_per_node=auto` (one process per GPU)."
    ),
}

# strategy -> (the capability its task must declare, why; {task} is the task's name).
STRATEGY_NEEDS_TASK: dict[str, tuple[str, str]] = {
    "pipeline": (
        "pipeline",
        "strategy=pipeline with task={task}: the pipeline schedule computes the loss on its "
        "last stage as loss(model(inputs), targets), which only task=classification "
        "provides. Use `strategy=ddp` or `strategy=fsdp`.",
    ),
}

# strategy -> (its key that, above 1, gives it another strategy's limits; that strategy's row):
# FSDP x TP (`strategy=fsdp strategy.tp=N`) has tensor parallelism's limits too.
ROW_WITH: dict[str, tuple[str, str]] = {"fsdp": ("tp", "tp")}

# (strategy row, precision.name) -> why the pair is refused.
PRECISION_REFUSED: dict[tuple[str, str], str] = {
    ("tp", "fp16"): (
        "precision=fp16 with tensor parallelism (strategy=tp, or strategy.tp under fsdp) is "
        "not supported: its GradScaler would unscale and check a mix of whole and sharded "
        "(DTensor) gradients, which accel-train does not test. Use `precision=bf16` (no "
        "scaler) or `precision=fp32`."
    ),
}


def strategy_key(cfg: DictConfig) -> str:
    """The strategy's row in the tables above (ROW_WITH)."""
    name = cfg.strategy.name
    key, row = ROW_WITH.get(name, (None, name))
    if key is not None and int(cfg.strategy.get(key, 1)) > 1:
        return row
    return name


def check_strategy_transforms(cfg: DictConfig) -> None:
    """Refuse a model transform (the REFUSED table) or an optimizer (OPTIMIZER_REFUSED) the
    chosen strategy does not support."""
    strategy = strategy_key(cfg)
    why = OPTIMIZER_REFUSED.get((strategy, cfg.optimizer.name))
    if why is not None:
        raise UserError(why)
    for transform, (_, on) in TRANSFORMS.items():
        why = REFUSED.get((strategy, transform))
        if why is not None and on(cfg):
            raise UserError(why)
    why = PRECISION_REFUSED.get((strategy, cfg.precision.name))
    if why is not None:
        raise UserError(why)
