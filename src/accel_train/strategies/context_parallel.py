"""Context parallelism (`strategy=fsdp strategy.cp=N`): each sequence of a batch is split over
the N processes of a `cp` group, and attention runs as ring attention, through PyTorch's own
`torch.distributed.tensor.experimental.context_parallel` (torchtitan's CP).

How a step runs (the loop's `_forward_backward`, inside `Strategy.sequence_shards`):
- the task hands over its batch with explicit positions (`Task.sequence_buffers`: the language
  model's inputs, targets and `position_ids`), so that each rank's part of a sequence keeps its
  true positions (a learned position table, RoPE);
- `context_parallel` splits those tensors along the sequence in place (load-balanced for causal
  attention: each rank a chunk from the front and its mirror from the back) and patches SDPA
  to ring attention over the `cp` group, for forward and backward; the tensors are restored
  afterwards;
- each rank's loss is the sum over its own tokens; the normaliser divides every gradient by the
  tokens of the whole batch (all processes) and FSDP's reduce-scatter averages over
  dp_shard x cp, which `Loop._normalise_gradients` accounts for (`Strategy.sequence_split`).

The parameters are sharded by FSDP over the flattened dp_shard x cp mesh (torchtitan's
`dp_shard_cp`): the ranks of a cp group compute gradients of the same weights from different
tokens, which FSDP reduces like any data-parallel gradient.

PyTorch's ring attention implements CUDA's SDPA kernels only (flash, memory-efficient, cuDNN),
and is causal only: a CPU run, and packed rows (a block-diagonal mask), are refused before
any process starts (`check_context_parallel`). scripts/gpu_check.sh runs it on two GPUs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig

from accel_train.config.device_checks import cpu_run
from accel_train.errors import UserError


def check_context_parallel(cfg: DictConfig, cp: int, tp: int, world: int, keys: Any) -> None:
    """strategy.cp before any process starts: a degree that divides the processes (with TP's),
    a CUDA run, unpacked rows the load balancer can cut in 2 x cp chunks. Every refusal that
    applies is reported at once (numbered), so that fixing one does not reveal the next."""
    if cp < 1:
        raise UserError(f"strategy.cp={cp} must be >= 1 (1 = no context parallelism).")
    if cp == 1:
        return
    found = [why for why in (_world(cp, tp, world, keys), *_run_refusals(cfg, cp)) if why]
    if len(found) == 1:
        raise UserError(found[0])
    if found:
        listed = " ".join(f"({i}) {why}" for i, why in enumerate(found, 1))
        raise UserError(f"strategy.cp={cp} cannot run here, for {len(found)} reasons: {listed}")


def _world(cp: int, tp: int, world: int, keys: Any) -> str | None:
    if not world % (cp * max(tp, 1)):
        return None
    with_tp = f" x strategy.tp={tp}" if tp > 1 else ""
    each = ", each of them a TP group" if tp > 1 else ""
    return (
        f"strategy.cp={cp}{with_tp} must divide the {world} process"
        f"{'es' if world != 1 else ''} (each "
        f"context-parallel group holds cp of them{each})."
        f" Set {keys.count} to a multiple of {cp * max(tp, 1)}, or `strategy.cp` "
        f"to a divisor of {world // max(tp, 1)}."
    )


def _run_refusals(cfg: DictConfig, cp: int) -> list[str | None]:
    """What the run's device, rows and model leave impossible for ring attention."""
    why = cpu_run(cfg)
    block = cfg.model.get("block_size") or cfg.dataset.get("max_length")
    return [
        why
        and (
            f"strategy.cp={cp} splits each sequence over {cp} GPUs with ring attention, which "
            "PyTorch implements for CUDA's attention kernels only; this run trains on the CPU "
            f"({why}). Set `strategy.cp=1`; on a CPU, long rows fit with "
            "`task.chunked_loss=true` and `activation_checkpointing.mode=full` "
            "(docs/long-context.md)."
        ),
        block
        and int(block) % (2 * cp)
        and (
            f"strategy.cp={cp}: rows of {block} tokens do not split into {2 * cp} equal chunks "
            "(context parallelism gives each GPU a chunk from the front of the sequence and "
            f"its mirror from the back). Use a row length that is a multiple of {2 * cp}."
        ),
        cfg.model.get("name") == "hf"
        and (
            f"strategy.cp={cp} with model=hf is not supported yet: transformers reads the "
            "positions of a split row (a chunk from each end) as packed records. Use "
            "`model=gpt` (its positions are passed through), or `strategy.cp=1`."
        ),
        (cfg.dataset.get("pack") or cfg.dataset.get("document_separator") is not None)
        and (
            f"strategy.cp={cp} with packed rows (dataset.pack / dataset.document_separator): "
            "PyTorch's ring attention is causal over the whole row and cannot keep records "
            "apart. Train with unpacked rows, or `strategy.cp=1`."
        ),
    ]


@contextlib.contextmanager
def sharded_sequences(mesh: Any, task: Any, batch: Any) -> Iterator[Any]:
    """The batch with its sequences split over the `cp` mesh, for one forward and backward."""
    split = getattr(task, "sequence_buffers", None)
    if split is None:
        raise UserError(
            f"strategy.cp needs a task that hands over its sequences (task={task.name} does "
            "not): context parallelism splits token rows, as task=language_model's. Set "
            "`strategy.cp=1`."
        )
    from torch.distributed.tensor.experimental import context_parallel

    batch, buffers = split(batch)
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
        yield batch
